"""docs/megatron_lm.md's fault table is tests/fault_matrix.py's, and names only tests that exist."""

import subprocess
import sys
from pathlib import Path

from fault_matrix import BEGIN, END, FAULTS, render

ROOT = Path(__file__).resolve().parent.parent


def test_the_docs_hold_the_fault_table():
    text = (ROOT / "docs" / "megatron_lm.md").read_text()
    assert BEGIN in text and END in text, "docs/megatron_lm.md has no fault table"
    table = text[text.index(BEGIN):text.index(END) + len(END)]
    assert table == render(), "regenerate it: python -c 'import sys; sys.path.insert(0, \"tests\"); " \
                              "import fault_matrix; print(fault_matrix.render())'"


def test_every_test_the_table_names_exists():
    named = {test for _fault, _outcome, tests in FAULTS for test in tests}
    files = sorted({test.split("::")[0] for test in named})
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *files], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    collected = {line.split("[")[0] for line in proc.stdout.splitlines() if "::" in line}
    missing = named - collected
    assert not missing, f"the fault table names tests that do not exist: {sorted(missing)}"

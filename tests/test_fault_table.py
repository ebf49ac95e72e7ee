"""docs/megatron_lm.md's fault table is tests/fault_matrix.py's, and names only tests that exist."""

import ast
from pathlib import Path

from fault_matrix import BEGIN, END, FAULTS, render

ROOT = Path(__file__).resolve().parent.parent


def test_the_docs_hold_the_fault_table():
    text = (ROOT / "docs" / "megatron_lm.md").read_text()
    assert BEGIN in text and END in text, "docs/megatron_lm.md has no fault table"
    table = text[text.index(BEGIN):text.index(END) + len(END)]
    assert table == render(), "regenerate it: python -c 'import sys; sys.path.insert(0, \"tests\"); " \
                              "import fault_matrix; print(fault_matrix.render())'"


def _defined_tests(path: Path) -> set[str]:
    """`file::test` and `file::Class::test` for each test function the file defines
    (what pytest collects from it, parameters aside)."""
    rel = path.relative_to(ROOT).as_posix()
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            found.add(f"{rel}::{node.name}")
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            found |= {f"{rel}::{node.name}::{f.name}" for f in node.body
                      if isinstance(f, ast.FunctionDef) and f.name.startswith("test")}
    return found


def test_every_test_the_table_names_exists():
    named = {test for _fault, _outcome, tests in FAULTS for test in tests}
    files = sorted({test.split("::")[0] for test in named})
    defined = set().union(*(_defined_tests(ROOT / f) for f in files if (ROOT / f).exists()))
    missing = named - defined
    assert not missing, f"the fault table names tests that do not exist: {sorted(missing)}"


def test_a_missing_test_is_found():
    """The negative control: a name no file defines is reported missing."""
    defined = _defined_tests(ROOT / "tests" / "test_fault_table.py")
    assert "tests/test_fault_table.py::test_every_test_the_table_names_exists" in defined
    assert "tests/test_fault_table.py::test_no_such_test" not in defined

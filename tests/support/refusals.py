"""Check many command lines against Megatron's argument validation in one process.

    python -m tests.support.refusals CASES.json OUT.json

CASES.json maps a case name to {"world": N, "argv": [...]}. Each command line goes
through megatron_async.check_flags (Megatron's argument parser and `validate_args`
with the plugin installed, the launcher's CPU flags added, under WORLD_SIZE=N). OUT.json
maps each name to {"refused": bool, "error": message or None}. One process for all
cases, since importing Megatron costs seconds a process (the tests run it forked from
their warm forkserver: tests/support/warm_launch.warm_python), and Megatron's parser reads
its config classes' docstrings once (tests/support/warm_imports.py), not once per case.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def check_in_one_process(cases: dict, folder: Path, timeout_s: float = 300) -> dict:
    """Run this module over `cases` ({name: {"world": N, "argv": [...]}}) in one warm
    process, with its files in `folder`; returns OUT.json's results."""
    from tests.support.warm_launch import warm_python

    folder = Path(folder)
    (folder / "cases.json").write_text(json.dumps(cases))
    proc = warm_python("tests.support.refusals", [folder / "cases.json", folder / "out.json"], timeout_s)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return json.loads((folder / "out.json").read_text())


def main(cases_path: str, out_path: str) -> None:
    import importlib

    from megatron_async.check_flags import check, prepare

    importlib.import_module("tests.support.warm_imports")  # each parse reuses the config docstrings

    prepare()
    with open(cases_path, encoding="utf-8") as f:
        cases = json.load(f)
    results = {name: check(case["argv"], case["world"], cpu_flags=True) for name, case in cases.items()}
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])

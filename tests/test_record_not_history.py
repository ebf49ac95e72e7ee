"""The benchmarks document is a record, and the package ships no test-only code.

- docs/benchmarks.md states the current numbers, each with its command and date; how they
  changed over time is in bench/archive/benchmarks_history.md. So it has no "used to", "no
  longer", "retired", "as before", "since removed" and no issue number.
- No docstring or comment in megatron_async/ says that what it documents is "for tests":
  test-only helpers live in tests/support.
- README states one suite time, and it is the one docs/benchmarks.md's "The test suite's time"
  records as measured (its bold m:ss), not an estimate or a goal.
Negative controls: a planted sentence of each kind is found, and an estimate is no suite time.
"""

import ast
import io
import re
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "docs" / "benchmarks.md"
README = REPO / "README.md"
HISTORY = re.compile(r"\bused to\b|\bno longer\b|\bretired\b|\bas before\b|\bsince removed\b|\bpreviously\b"
                     r"|\bformerly\b|\bissues? \d+|#\d+\b", re.IGNORECASE)
FOR_TESTS = re.compile(r"\bfor (?:the )?tests\b", re.IGNORECASE)


def history_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if HISTORY.search(line)]


def docstrings_and_comments(source: str) -> list[str]:
    """Each docstring and comment of a module, its whitespace collapsed (a phrase may wrap)."""
    parts = [ast.get_docstring(node) or "" for node in ast.walk(ast.parse(source))
             if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    parts += [tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline)
              if tok.type == tokenize.COMMENT]
    return [" ".join(part.split()) for part in parts if part]


def says_for_tests(source: str) -> list[str]:
    return [part for part in docstrings_and_comments(source) if FOR_TESTS.search(part)]


def test_the_benchmarks_document_narrates_no_history():
    assert history_lines(BENCHMARKS.read_text(encoding="utf-8")) == []


def test_negative_control_history_is_found():
    planted = "| a | 1.0 |\nThe harness used to time it (issue 17); it is retired now.\nCommand: `make bench`, 2026-11-24.\n"
    assert history_lines(planted) == ["The harness used to time it (issue 17); it is retired now."]


def test_no_package_docstring_or_comment_says_for_tests():
    found = {str(path.relative_to(REPO)): hits for path in sorted((REPO / "megatron_async").rglob("*.py"))
             if (hits := says_for_tests(path.read_text(encoding="utf-8")))}
    assert found == {}


def test_negative_control_for_tests_is_found():
    planted = 'def report():\n    """This rank\'s sends left unwaited at exit, for\n    tests."""\n'
    assert says_for_tests(planted) == ["This rank's sends left unwaited at exit, for tests."]


_MIN_SEC = re.compile(r"(?<![\w:])(\d{1,2}:\d\d)(?![\w:])")


def suite_times(readme: str) -> list[str]:
    """Every m:ss time README states (it states no other kind)."""
    return _MIN_SEC.findall(readme)


def measured_suite_time(benchmarks: str) -> str:
    """The bold m:ss of the section "The test suite's time": the run it records as measured."""
    section = benchmarks.split("## The test suite's time\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"\*\*(\d{1,2}:\d\d)\*\*", section).group(1)


def test_readme_states_the_measured_suite_time():
    measured = measured_suite_time(BENCHMARKS.read_text(encoding="utf-8"))
    assert suite_times(README.read_text(encoding="utf-8")) == [measured]


def test_negative_control_an_estimate_is_no_suite_time():
    assert suite_times("then the rest (about 8 minutes on 2 cores, setup included)") == []
    assert suite_times("10:56 in all; the one before 10:03") == ["10:56", "10:03"]

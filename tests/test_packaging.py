"""The built wheel holds every module of the package, and nothing of the tests.

`make setup` installs the package in editable mode, where a folder without __init__.py
still imports (a namespace package); a wheel, as docker/install.sh installs it into a
container, leaves such a folder out. Negative control: a copy of the package with one
__init__.py removed builds a wheel without that folder's modules.

The tests' support (tests/support/) lives in the checkout, not in the wheel, and no module
the wheel ships imports it, anything else of the checkout (tests, bench) or a module of
the package the wheel lacks: an installed plugin, the planner included, needs no checkout.
Negative controls: a file list with test support in it and a module importing it (a
planner that takes its model-parallel setup from test support again) are both flagged.
One wheel, built once, serves every check but the first control.
"""

import ast
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CHECKOUT_ONLY = ("tests", "bench")  # top-level packages of the checkout that the wheel leaves out
_MODULE_NAME = re.compile(r"(%s)(\.\w+)+" % "|".join(CHECKOUT_ONLY))  # a module run by name (-m, runpy)


def _build(source: Path, out: Path) -> Path:
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(out), str(source)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = out.glob("megatron_async-*.whl")
    return wheel


def _wheel_modules(wheel: Path) -> set[str]:
    return {name for name in zipfile.ZipFile(wheel).namelist() if name.endswith(".py")}


def _wheel_sources(wheel: Path) -> dict[str, str]:
    with zipfile.ZipFile(wheel) as archive:
        return {name: archive.read(name).decode("utf-8") for name in archive.namelist() if name.endswith(".py")}


def _source_modules(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in (root / "megatron_async").rglob("*.py")}


_ANYWHERE = shutil.ignore_patterns("*.egg-info", "__pycache__", ".pytest_cache", "archive")
_AT_THE_ROOT = {".venv", ".git", "data", "out", "build"}  # not megatron_async/data, a package


def _copy(tmp_path) -> Path:
    """The sources, copied, so that building leaves nothing in the checkout."""
    copy = tmp_path / "src"

    def ignore(folder, names):
        return _ANYWHERE(folder, names) | (_AT_THE_ROOT & set(names) if Path(folder) == REPO else set())

    shutil.copytree(REPO, copy, ignore=ignore)
    return copy


def not_the_package(names: list[str]) -> list[str]:
    """Entries of a wheel that are not the package's own: anything outside megatron_async/
    and its metadata, and anything in a folder named tests or testing."""
    found = []
    for name in names:
        parts = name.split("/")
        outside = parts[0] != "megatron_async" and not re.fullmatch(r"megatron_async-[^/]+\.dist-info", parts[0])
        if outside or {"tests", "testing"} & set(parts[:-1]):
            found.append(name)
    return sorted(found)


def _module(path: str) -> str:
    parts = path.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def checkout_imports(sources: dict[str, str]) -> list[str]:
    """`path:line module` for each import (inside functions too) of the shipped modules that
    an installed wheel cannot satisfy: tests or bench (also named as a string, as `-m` and
    runpy take a module), or a module of the package that is not among `sources`."""
    shipped = {_module(path) for path in sources}
    found = []
    for path, text in sorted(sources.items()):
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _MODULE_NAME.fullmatch(node.value):
                targets = [node.value]
            else:
                continue
            for target in targets:
                top = target.split(".")[0]
                if top in CHECKOUT_ONLY or (top == "megatron_async" and target not in shipped):
                    found.append(f"{path}:{node.lineno} {target}")
    return found


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """(the copied sources, the wheel built from them)."""
    tmp = tmp_path_factory.mktemp("packaging")
    copy = _copy(tmp)
    return copy, _build(copy, tmp / "wheel")


def test_the_wheel_holds_every_module(wheel):
    copy, built = wheel
    assert _source_modules(copy) - _wheel_modules(built) == set()


def test_negative_control_a_folder_without_init_is_left_out(tmp_path):
    copy = _copy(tmp_path)
    (copy / "megatron_async" / "megatron_lm" / "__init__.py").unlink()
    missing = _source_modules(copy) - _wheel_modules(_build(copy, tmp_path / "wheel"))
    assert missing and all(name.startswith("megatron_async/megatron_lm/") for name in missing), missing


def test_the_wheel_ships_no_test_support(wheel):
    copy, built = wheel
    assert (copy / "tests" / "support" / "tiny_gpt.py").exists()  # in the sources the wheel was built from
    names = zipfile.ZipFile(built).namelist()
    assert "megatron_async/cpu.py" in names and "megatron_async/planning/parallel.py" in names
    assert not_the_package(names) == []


def test_no_shipped_module_imports_the_checkout(wheel):
    sources = _wheel_sources(wheel[1])
    assert len(sources) > 50 and "megatron_async/planning/plan.py" in sources
    assert checkout_imports(sources) == []


def test_negative_control_test_support_in_the_wheel_is_flagged(wheel):
    names = ["megatron_async/__init__.py", "megatron_async/testing/tiny_gpt.py", "tests/support/launch.py",
             "megatron_async-0.1.0.dist-info/RECORD"]
    assert not_the_package(names) == ["megatron_async/testing/tiny_gpt.py", "tests/support/launch.py"]
    sources = _wheel_sources(wheel[1])
    plan = sources["megatron_async/planning/plan.py"]
    assert "from megatron_async.planning.parallel import init_model_parallel" in plan
    sources["megatron_async/planning/plan.py"] = plan.replace("megatron_async.planning.parallel",
                                                              "megatron_async.testing.parallel")
    sources["megatron_async/planted.py"] = ("def run():\n    from tests.support.tiny_gpt import build\n"
                                            "    return ['-m', 'tests.support.step_end_entry']\n")
    found = checkout_imports(sources)
    assert [f.split(" ", 1)[1] for f in found] == ["megatron_async.testing.parallel", "tests.support.tiny_gpt",
                                                  "tests.support.step_end_entry"], found


def test_readme_names_the_extras_make_setup_installs():
    """README's `make setup` sentence gives the extras the Makefile's install line installs."""
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    readme = " ".join((REPO / "README.md").read_text(encoding="utf-8").split())
    installed = re.search(r"pip install [^\n]*-e '\.\[([\w,]+)\]'", makefile)
    said = re.search(r"`make setup` creates `\.venv` and installs `-e \.\[([\w,]+)\]`", readme)
    assert installed and said, (installed, said)
    assert set(said.group(1).split(",")) == set(installed.group(1).split(",")), (said.group(1), installed.group(1))

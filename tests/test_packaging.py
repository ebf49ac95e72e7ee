"""The built wheel holds every module of the package.

`make setup` installs the package in editable mode, where a folder without __init__.py
still imports (a namespace package); a wheel, as docker/install.sh installs it into a
container, leaves such a folder out. Negative control: a copy of the package with one
__init__.py removed builds a wheel without that folder's modules.
"""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _wheel_modules(source: Path, out: Path) -> set[str]:
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(out), str(source)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = out.glob("megatron_async-*.whl")
    return {name for name in zipfile.ZipFile(wheel).namelist() if name.endswith(".py")}


def _source_modules(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in (root / "megatron_async").rglob("*.py")}


def _copy(tmp_path) -> Path:
    """The sources, copied, so that building leaves nothing in the checkout."""
    copy = tmp_path / "src"
    shutil.copytree(REPO, copy, ignore=shutil.ignore_patterns(".venv", ".git", "data", "out", "build", "*.egg-info",
                                                              "__pycache__", ".pytest_cache", "archive"))
    return copy


def test_the_wheel_holds_every_module(tmp_path):
    copy = _copy(tmp_path)
    assert _source_modules(copy) - _wheel_modules(copy, tmp_path / "wheel") == set()


def test_negative_control_a_folder_without_init_is_left_out(tmp_path):
    copy = _copy(tmp_path)
    (copy / "megatron_async" / "megatron_lm" / "__init__.py").unlink()
    missing = _source_modules(copy) - _wheel_modules(copy, tmp_path / "wheel")
    assert missing and all(name.startswith("megatron_async/megatron_lm/") for name in missing), missing

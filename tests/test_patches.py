"""patches/ still applies to Megatron-LM at the pin, and the patched package installs the plugin.

The target file, megatron/training/__init__.py at Megatron-LM f8837c04, is the one
the megatron-core 0.19.2 wheel ships (byte-identical), so CI checks the patch
against the installed wheel: a copy of the wheel's `megatron` package is patched
and imported in a fresh interpreter.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import megatron.training

MEGATRON = Path(megatron.training.__file__).parent.parent  # a namespace package: no __file__
PATCH = Path(__file__).resolve().parent.parent / "patches" / "megatron-lm-f8837c04-megatron-async.patch"


def _patched_copy(tmp_path) -> Path:
    root = tmp_path / "megatron-lm"
    shutil.copytree(MEGATRON, root / "megatron")
    check = subprocess.run(["git", "apply", "--check", str(PATCH)], cwd=root, capture_output=True, text=True)
    assert check.returncode == 0, f"{PATCH.name} no longer applies: {check.stderr}"
    subprocess.run(["git", "apply", str(PATCH)], cwd=root, check=True)
    return root


def test_patch_applies_and_importing_megatron_training_installs_the_hooks(tmp_path):
    root = _patched_copy(tmp_path)
    probe = (
        "import megatron.training, megatron.training.training as t\n"
        f"assert megatron.training.__file__.startswith({str(root)!r}), megatron.training.__file__\n"
        "from megatron_async.megatron_lm import hooks\n"
        "assert hooks._INSTALLED, 'hooks not installed'\n"
        "assert t.get_forward_backward_func.__wrapped__\n"
        "import sys; sys.argv = ['pretrain_gpt.py', '--help']\n"
        "from megatron.training.arguments import parse_args\n"
        "parse_args()\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "--pipeline-schedule" in out.stdout and "megatron-async" in out.stdout


def test_unpatched_megatron_has_no_hooks(tmp_path):
    """The negative control: the same probe without the patch finds nothing installed."""
    root = tmp_path / "megatron-lm"
    shutil.copytree(MEGATRON, root / "megatron")
    probe = ("import megatron.training\nfrom megatron_async.megatron_lm import hooks\n"
             "assert not hooks._INSTALLED\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]

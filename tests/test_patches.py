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
        "from megatron_async.megatron_lm.adapter import hooks\n"
        "assert hooks._INSTALLED, 'hooks not installed'\n"
        "assert t.get_forward_backward_func.__wrapped__\n"
        # the hooks only: the CPU emulation stays off, so without CUDA Megatron stops at start-up (PATCH_ROUTE_NEEDS)
        "from megatron_async import cpu; import torch\n"
        "assert not cpu.is_active(), 'the patched import turned the CPU emulation on'\n"
        "if not torch.cuda.is_available():\n"
        "    try:\n"
        "        t.initialize_megatron()\n"
        "    except AssertionError as error:\n"
        "        assert str(error) == 'Megatron requires CUDA.', error\n"
        "    else:\n"
        "        raise AssertionError('initialize_megatron started without CUDA or the emulation')\n"
        "import sys; sys.argv = ['pretrain_gpt.py', '--help']\n"
        "from megatron.training.arguments import parse_args\n"
        "parse_args()\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "--pipeline-schedule" in out.stdout and "megatron-async" in out.stdout


# What the documents say of the patch route on a machine without CUDA, where they describe it
PATCH_ROUTE_NEEDS = {"docs/megatron_lm.md": "2. **`patches/`**", "patches/README.md": "# Patches for Megatron-LM"}


def test_the_documents_say_the_patch_route_needs_cuda_or_the_launcher():
    """Where docs/megatron_lm.md and patches/README.md describe the patch route, they say
    that it needs CUDA (the probe above: the patched import leaves the emulation off) and
    that the launcher runs the same script on a CPU."""
    repo = PATCH.parent.parent
    for document, start in PATCH_ROUTE_NEEDS.items():
        text = (repo / document).read_text()
        assert start in text, document
        route = " ".join(text.split(start, 1)[1].split("\n3. ", 1)[0].split())  # to the next way in
        assert "This route needs a CUDA GPU" in route and '"Megatron requires CUDA."' in route, document
        assert "through the launcher" in route and "turns the emulation on" in route, document


def test_unpatched_megatron_has_no_hooks(tmp_path):
    """The negative control: the same probe without the patch finds nothing installed."""
    root = tmp_path / "megatron-lm"
    shutil.copytree(MEGATRON, root / "megatron")
    probe = ("import megatron.training\nfrom megatron_async.megatron_lm.adapter import hooks\n"
             "assert not hooks._INSTALLED\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


def test_a_refusal_in_a_patched_script_is_our_one_line_and_exit_code(tmp_path):
    """A training script with the patched Megatron has no launcher of ours to catch a
    refusal: the hooks' excepthook prints our one line (no traceback) and exits 2.
    Negative control: the same script with Python's own excepthook gives a traceback
    and exit 1."""
    from test_long_runs import _PATCHED_SCRIPT

    root = _patched_copy(tmp_path)
    script = root / "pretrain_gpt_stand_in.py"
    script.write_text(_PATCHED_SCRIPT.format(root=str(root)))
    plain = root / "plain_excepthook.py"
    plain.write_text("import sys, runpy\nimport megatron.training\nsys.excepthook = sys.__excepthook__\n"
                     f"sys.argv = sys.argv[1:]\nrunpy.run_path({str(script)!r}, run_name='__main__')\n")
    args = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "8", "--mock-data",
            "--vocab-size", "256", "--train-iters", "2", "--lr", "1e-4", "--eval-interval", "100",
            "--pipeline-schedule", "zigzag"]
    ours = subprocess.run([sys.executable, str(script), *args], cwd=root, capture_output=True, text=True, timeout=300)
    assert ours.returncode == 2, ours.stderr[-3000:]
    last = ours.stderr.strip().splitlines()[-1]
    assert last.startswith("megatron-async: error: --pipeline-schedule 'zigzag'"), ours.stderr[-3000:]
    assert "Traceback" not in ours.stderr
    control = subprocess.run([sys.executable, str(plain), str(script), *args], cwd=root, capture_output=True,
                             text=True, timeout=300)
    assert control.returncode == 1 and "Traceback" in control.stderr, control.stderr[-3000:]


def test_the_launcher_on_a_patched_checkout_hooks_each_name_once(tmp_path):
    """`python -m megatron_async.launch pretrain_gpt.py` in a patched checkout: the launcher's
    install() imports megatron.training, whose patched __init__ installs the hooks first.
    Each Megatron name must be wrapped once: twice, Megatron's parser gets
    --pipeline-schedule twice ("conflicting option string") and every hook runs twice."""
    root = _patched_copy(tmp_path)
    probe = (
        "import sys\n"
        "from megatron_async.megatron_lm.adapter.hooks import install, _INSTALLED\n"
        "install()\n"
        "import megatron.training.arguments as A, megatron.training.training as T\n"
        f"assert A.__file__.startswith({str(root)!r}), A.__file__\n"
        "for fn in (A.add_megatron_arguments, T.train_step, T.get_forward_backward_func):\n"
        "    assert not hasattr(fn.__wrapped__, '__wrapped__'), f'{fn.__name__} is hooked twice'\n"
        "sys.argv = ['pretrain_gpt.py', '--help']\n"
        "A.parse_args()\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "--pipeline-schedule" in out.stdout

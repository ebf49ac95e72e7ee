"""The GPU acceptance suite on a machine without CUDA: it skips every test, says why,
and exits 0; `make test` leaves it out and `make test-gpu` runs it without the CPU venv."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the suite's behaviour without CUDA")
def test_gpu_suite_skips_without_cuda_and_says_so():
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "tests/gpu"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]  # not 5: the suite always collects its tests
    assert "needs a CUDA GPU" in out, out[-3000:]
    assert " skipped" in out and " passed" not in out and " failed" not in out, out[-3000:]


def test_make_test_leaves_the_gpu_suite_out_and_test_gpu_runs_it():
    def dry(target):
        return subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True, timeout=60).stdout

    assert "--ignore=tests/gpu" in dry("test")
    gpu = dry("test-gpu")
    assert "pytest -q tests/gpu" in gpu and ".venv" not in gpu


# Three "ranks" under one launcher: rank 1 exits at once, the others wait (as ranks do on
# a collective the dead one never joins).
_HANGING_LAUNCHER = """
import os, subprocess, sys, time
for rank in range(3):
    code = "import sys" if rank == 1 else "import time; time.sleep(120)"
    subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ, RANK=str(rank)))
time.sleep(120)
"""


def test_a_run_past_its_timeout_names_the_rank_that_exited():
    """The GPU suite's launcher, on a timeout, says which ranks were still running and
    which had gone, and leaves none behind."""
    from tests.support.gpu.launch import run_with_timeout

    with pytest.raises(TimeoutError) as err:
        run_with_timeout([sys.executable, "-c", _HANGING_LAUNCHER], 4, nproc=3)  # rank 1: a bare interpreter
    message = str(err.value)
    assert "ranks still running at the timeout: [0, 2]; exited before it: [1]" in message, message
    lingering = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if b"time.sleep(120)" in cmdline.read_bytes():
                lingering.append(cmdline.parent.name)
        except OSError:
            continue
    assert not lingering, lingering

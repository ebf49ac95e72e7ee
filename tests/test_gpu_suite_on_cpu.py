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

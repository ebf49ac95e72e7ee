"""What one GPU shows of the optimizer options and the save (1 GPU).

- `--use-precision-aware-optimizer` (TE's FusedAdam keeps the fp32 master weights and
  reads `.decoupled_grad`) with `--delay-correction ef` under `--simulated-delay 1` is
  refused before the first iteration, naming both flags; the same run without the
  correction trains (control: the refusal is ours, not a broken optimizer).
- A torch-format save of a `--simulated-delay 1` run adds nothing to the GPU's peak
  memory: the stash streams to the host (tests/test_stash_save.py records the copies
  on the CPU). Control: a device-side clone of the stash adds at least the stash's bytes.
"""

import json
import re

import pytest

from tests.support.gpu.gpt_flags import gpt_flags
from tests.support.gpu.launch import run_with_timeout, tail, torchrun_gpt

TIMEOUT_S = 300
PRECISION_AWARE = ["--use-distributed-optimizer", "--use-precision-aware-optimizer", "--simulated-delay", 1]


@pytest.mark.te
@pytest.mark.timeout(2 * TIMEOUT_S + 60)
def test_precision_aware_optimizer_with_ef_is_refused_before_training(tmp_path, gpu_record):
    refused = torchrun_gpt(gpt_flags(iters=4) + PRECISION_AWARE + ["--delay-correction", "ef"], 1, TIMEOUT_S)
    out = refused.stdout
    gpu_record(refused_rc=refused.returncode)
    assert refused.returncode != 0, tail(refused)
    assert "--delay-correction ef" in out and "--use-precision-aware-optimizer" in out, tail(refused)
    assert not re.search(r"iteration\s+1/", out), tail(refused)  # Megatron's first log line never came
    trained = torchrun_gpt(gpt_flags(iters=4) + PRECISION_AWARE, 1, TIMEOUT_S)
    gpu_record(control_rc=trained.returncode)
    assert trained.returncode == 0, tail(trained)


def _save_peaks(tmp_path, clone: bool) -> list[dict]:
    import sys

    record = tmp_path / f"saves_{clone}.jsonl"
    flags = gpt_flags(iters=4, impl="local") + ["--simulated-delay", 1, "--save", tmp_path / f"ckpt_{clone}",
                                                "--save-interval", 2, "--ckpt-format", "torch"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           "-m", "tests.support.gpu.save_memory_entry", "--gpt", *map(str, flags)]
    proc = run_with_timeout(cmd, TIMEOUT_S, env={"MEGATRON_ASYNC_TEST_SAVE_MEMORY": str(record),
                                                 "MEGATRON_ASYNC_TEST_SAVE_CLONE": "1" if clone else "0"}, nproc=1)
    assert proc.returncode == 0, tail(proc)
    return [json.loads(line) for line in record.read_text().splitlines()]


@pytest.mark.timeout(2 * TIMEOUT_S + 60)
def test_a_torch_format_save_adds_nothing_to_the_gpu_peak(tmp_path, gpu_record):
    saves, cloned = _save_peaks(tmp_path, False), _save_peaks(tmp_path, True)
    gpu_record(saves=saves, cloned=cloned)
    assert len(saves) == 2 and all(s["stash_bytes"] > 0 for s in saves), saves
    assert all(s["peak_added"] < 0.01 * s["stash_bytes"] for s in saves), saves
    assert all(c["peak_added"] >= c["stash_bytes"] for c in cloned), cloned

"""The tied-embedding link under NCCL's rules, shown on the CPU (megatron_async/cpu_nccl.py).

Tied 2bw at PP=2 with m = 4 > p microbatches, in Megatron's loop:
- The link's pair communicator is made by its first contact at link creation
  (pipeline/tied_embeddings.py `connect`). Negative control: the link as it was (a
  pair all-reduce, then the first stage's first gradient receive at its first backward)
  hangs at that receive under NCCL's lazy pair communicators; the emulation fails
  there, naming the pair, within its wait limit. With today's first contact the same
  early receive trains.
- `torch.cuda.empty_cache()` after every forward and backward of the first stage (an
  allocator retry can come anywhere in a batch) trains: the gradient receive is posted
  only after the batch's last forward. Negative control: posted at the batch's first
  backward, as it was, the first such wait waits for the last stage's step, which needs
  forwards the first stage has not run: the emulation fails naming the receive.
"""

import math

import pytest

from tests.support.loop_runs import CPU, MODEL, TRAIN, logged_losses
from tests.support.warm_launch import warm_run

TIED = [a for a in MODEL if a != "--untie-embeddings-and-output-weights"]
TWO_BW = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw"]
ENTRY = "tests.support.step_end_entry"
HANG_WAIT_S = 2  # the emulated NCCL waits give up after this in the controls (a step takes ~50 ms)
TIMEOUT_S = 240


def _run(tmp_path, name, switches, wait_s=30):
    metrics = tmp_path / f"{name}.jsonl"
    env = {"MEGATRON_ASYNC_CPU_SEND_WAIT_S": str(wait_s), **{f"MEGATRON_ASYNC_TEST_{s}": "1" for s in switches}}
    proc = warm_run(ENTRY, ["--gpt", *CPU, *TIED, *TRAIN, *TWO_BW, "--metrics-json", str(metrics)], 2, TIMEOUT_S,
                    env=env)
    return proc, metrics


def test_tied_2bw_trains_with_a_whole_device_wait_after_every_first_stage_action(tmp_path):
    proc, metrics = _run(tmp_path, "waits", ["EMPTY_CACHE_ON_STAGE0"])
    assert proc.returncode == 0, proc.stdout[-4000:]
    losses = logged_losses(metrics)
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses), losses


def test_the_first_contact_alone_removes_the_hang_of_the_early_receive(tmp_path):
    """The receive posted at the batch's first backward, as it was, with today's first contact:
    no hang without a whole-device wait (the early receive's other fault, below)."""
    proc, metrics = _run(tmp_path, "early", ["OLD_TIED_RECV"], wait_s=HANG_WAIT_S)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert len(logged_losses(metrics)) == 8


CONTROLS = {
    # the link as it was: a pair all-reduce instead of a first contact, the receive at the first backward
    "old link": (["OLD_TIED_CONTACT", "OLD_TIED_RECV"], "rank 0's first point-to-point operation with rank 1"),
    "old receive placement": (["OLD_TIED_RECV", "EMPTY_CACHE_ON_STAGE0"],
                              f"torch.cuda.empty_cache waited {HANG_WAIT_S} s for a point-to-point receive"),
}


@pytest.mark.parametrize("case", list(CONTROLS))
def test_negative_controls_the_old_link_hangs_where_nccl_would(tmp_path, case):
    switches, expected = CONTROLS[case]
    proc, _ = _run(tmp_path, case.replace(" ", "_"), switches, wait_s=HANG_WAIT_S)
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert expected in proc.stdout, proc.stdout[-3000:]

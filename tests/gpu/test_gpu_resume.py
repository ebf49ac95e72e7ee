"""A torch_dist checkpoint resume under 2bw equals the uninterrupted run (2 GPUs, TE).

2bw at PP=2 with dropout 0.1, Transformer Engine in bf16: saved at iteration 4
(exiting there), resumed to 8; the losses of the interrupted run equal those of
the uninterrupted one within RESUME_RTOL (the largest relative difference over
iterations; both runs use deterministic NCCL and TE kernels, so only
non-reproducible kernels could move it). Negative control: the same checkpoint
without its marker file (megatron_async.json) resumes without the weight stash,
so batch 5 runs at W4 instead of W3 and the same number exceeds RESUME_RTOL.
"""

import json
import shutil

import pytest

from megatron_async.testing.gpu_compare import finite_losses, max_relative_difference
from megatron_async.testing.gpu_gpt_flags import gpt_flags, two_bw
from megatron_async.testing.gpu_launch import DETERMINISTIC_ENV, read_metrics, tail, torchrun_gpt, train_losses

ITERS, SAVED_AT = 8, 4
RESUME_RTOL = 5e-3
TIMEOUT_S = 600
BASE = gpt_flags(iters=ITERS, lr=5e-3, micro_batch=2, global_batch=16, dropout=0.1) + two_bw(2) + [
    "--ckpt-format", "torch_dist"]


def _run(tmp_path, name: str, extra: list) -> list[float]:
    metrics = tmp_path / f"{name}.jsonl"
    proc = torchrun_gpt(BASE + extra + ["--metrics-json", metrics], 2, TIMEOUT_S, env=DETERMINISTIC_ENV)
    assert proc.returncode == 0, f"{name}:\n{tail(proc)}"
    return train_losses(read_metrics(metrics))


@pytest.mark.te
@pytest.mark.gpus(2)
@pytest.mark.timeout(4 * TIMEOUT_S + 120)
def test_torch_dist_resume_under_2bw_equals_the_uninterrupted_run(tmp_path, gpu_record):
    from megatron_async.megatron_lm.checkpoint import MARKER

    full = finite_losses(_run(tmp_path, "full", []), ITERS)
    ckpt, no_stash = tmp_path / "ckpt", tmp_path / "ckpt_without_stash"
    first = _run(tmp_path, "first", ["--save", ckpt, "--save-interval", SAVED_AT, "--exit-interval", SAVED_AT])
    marker = ckpt / f"iter_{SAVED_AT:07d}" / MARKER
    assert json.loads(marker.read_text())["weight_stash"], marker
    shutil.copytree(ckpt, no_stash)
    (no_stash / f"iter_{SAVED_AT:07d}" / MARKER).unlink()
    resumed = finite_losses(first + _run(tmp_path, "resumed", ["--load", ckpt]), ITERS)
    without = finite_losses(first + _run(tmp_path, "without_stash", ["--load", no_stash]), ITERS)
    difference = max_relative_difference(resumed, full)
    control = max_relative_difference(without, full)
    gpu_record(tolerance=RESUME_RTOL, max_rel_difference=difference, control_without_stash=control,
               full=full, resumed=resumed, resumed_without_stash=without)
    assert difference <= RESUME_RTOL, f"resumed {resumed} vs uninterrupted {full}: {difference:.2e}"
    assert control > RESUME_RTOL, f"resuming without the stash stays within {RESUME_RTOL} ({control:.2e}): no power"

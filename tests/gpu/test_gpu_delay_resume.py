"""A torch_dist resume of a delayed Muon + EF run equals the uninterrupted run (1 GPU).

`--simulated-delay 1` keeps the same weight stash as 2bw on one rank, and
`--delay-correction ef` keeps the previous update; both travel in the optimizer's
sharded state dict. On one GPU, in bf16 with NCCL and dropout 0.1: saved at
iteration 4 (exiting there), resumed to 8; the interrupted run's losses equal the
uninterrupted run's within RESUME_RTOL (largest relative difference over
iterations, deterministic kernels). Negative control: the same checkpoint without
its marker file (megatron_async.json) resumes without the stash and the EF state,
so batch 5 runs at W4 instead of W3, and the same number exceeds RESUME_RTOL.
This is the one-GPU form of test_gpu_resume.py, which needs 2 GPUs and TE.
"""

import json
import shutil

import pytest

from megatron_async.testing.gpu_compare import finite_losses, max_relative_difference
from megatron_async.testing.gpu_gpt_flags import MUON, gpt_flags
from megatron_async.testing.gpu_launch import DETERMINISTIC_ENV, read_metrics, tail, torchrun_gpt, train_losses

ITERS, SAVED_AT = 8, 4
RESUME_RTOL = 5e-3
TIMEOUT_S = 600


def _run(tmp_path, base: list, name: str, extra: list) -> list[float]:
    metrics = tmp_path / f"{name}.jsonl"
    proc = torchrun_gpt(base + extra + ["--metrics-json", metrics], 1, TIMEOUT_S, env=DETERMINISTIC_ENV)
    assert proc.returncode == 0, f"{name}:\n{tail(proc)}"
    return train_losses(read_metrics(metrics))


@pytest.mark.parametrize("impl", [pytest.param("transformer_engine", marks=pytest.mark.te), "local"])
@pytest.mark.timeout(4 * TIMEOUT_S + 120)
def test_delayed_muon_ef_resume_equals_the_uninterrupted_run(impl, tmp_path, gpu_record):
    from megatron_async.megatron_lm.checkpoint import MARKER

    base = gpt_flags(iters=ITERS, lr=5e-3, micro_batch=2, global_batch=16, dropout=0.1, impl=impl) + MUON + [
        "--simulated-delay", 1, "--delay-correction", "ef", "--ckpt-format", "torch_dist"]
    full = finite_losses(_run(tmp_path, base, "full", []), ITERS)
    ckpt, bare = tmp_path / "ckpt", tmp_path / "ckpt_without_marker"
    first = _run(tmp_path, base, "first", ["--save", ckpt, "--save-interval", SAVED_AT,
                                           "--exit-interval", SAVED_AT])
    marker = ckpt / f"iter_{SAVED_AT:07d}" / MARKER
    assert json.loads(marker.read_text())["weight_stash"], marker
    shutil.copytree(ckpt, bare)
    (bare / f"iter_{SAVED_AT:07d}" / MARKER).unlink()
    resumed = finite_losses(first + _run(tmp_path, base, "resumed", ["--load", ckpt]), ITERS)
    without = finite_losses(first + _run(tmp_path, base, "without_marker", ["--load", bare]), ITERS)
    difference = max_relative_difference(resumed, full)
    control = max_relative_difference(without, full)
    gpu_record(impl=impl, tolerance=RESUME_RTOL, max_rel_difference=difference, control_without_marker=control,
               full=full, resumed=resumed, resumed_without_marker=without)
    assert difference <= RESUME_RTOL, f"resumed {resumed} vs uninterrupted {full}: {difference:.2e}"
    assert control > RESUME_RTOL, f"resuming without the stash stays within {RESUME_RTOL} ({control:.2e}): no power"

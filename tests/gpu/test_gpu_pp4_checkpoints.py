"""2bw at PP=4 with frequent checkpoints and evaluations finishes and resumes (4 GPUs, TE).

One layer per stage, Transformer Engine in bf16, a torch_dist checkpoint every
SAVE iterations and an evaluation (on its own process group, while training
activations are in flight) every EVAL iterations. The first run exits at EXIT;
the second resumes from its last checkpoint and trains to ITERS, appending to the
same metrics file. Every iteration must then have exactly one finite training
loss, every evaluation its validation loss, every save its checkpoint with the
weight stash, and the loss must fall.
"""

import json
import math
import statistics

import pytest

from tests.support.gpu.gpt_flags import gpt_flags, two_bw
from tests.support.gpu.launch import read_metrics, tail, torchrun_gpt

ITERS, EXIT, SAVE, EVAL = 12, 6, 3, 2
TIMEOUT_S = 600


@pytest.mark.te
@pytest.mark.gpus(4)
@pytest.mark.timeout(2 * TIMEOUT_S + 120)
def test_pp4_2bw_saves_evaluates_and_resumes(tmp_path, gpu_record):
    from megatron_async.megatron_lm.checkpoint.marker import MARKER

    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    base = gpt_flags(iters=ITERS, lr=3e-3, micro_batch=2, global_batch=16) + two_bw(4) + [
        "--ckpt-format", "torch_dist", "--save", ckpt, "--save-interval", SAVE,
        "--eval-interval", EVAL, "--eval-iters", 2, "--metrics-json", metrics]
    first = torchrun_gpt(base + ["--exit-interval", EXIT], 4, TIMEOUT_S)
    assert first.returncode == 0, tail(first)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(EXIT)
    second = torchrun_gpt(base + ["--load", ckpt], 4, TIMEOUT_S)
    assert second.returncode == 0, tail(second)

    records = read_metrics(metrics)
    train = [r for r in records if "lm_loss" in r]
    valid = [r for r in records if "val_loss" in r]
    gpu_record(losses=[r["lm_loss"] for r in train], val_losses={r["iteration"]: r["val_loss"] for r in valid},
               wall_s=[round(first.wall_s, 1), round(second.wall_s, 1)])
    assert [r["iteration"] for r in train] == list(range(1, ITERS + 1))
    assert all(r["lm_loss"] is not None and math.isfinite(r["lm_loss"]) for r in train), train
    assert [r["iteration"] for r in valid] == list(range(EVAL, ITERS + 1, EVAL))
    assert all(r["val_loss"] is not None and math.isfinite(r["val_loss"]) for r in valid), valid
    for iteration in range(SAVE, ITERS + 1, SAVE):
        saved = ckpt / f"iter_{iteration:07d}"
        assert json.loads((saved / MARKER).read_text())["weight_stash"], saved
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)
    losses = [r["lm_loss"] for r in train]
    assert statistics.mean(losses[-3:]) < statistics.mean(losses[:3]), losses

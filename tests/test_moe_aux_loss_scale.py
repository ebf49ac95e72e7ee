"""2bw with the model features people train, in Megatron's own loop, on CPU and gloo.

For each feature, 2bw at PP=2 equals its `--simulated-delay 1 --simulated-pipeline-stages 2`
twin at PP=1 (same data parallel, tensor parallel and expert parallel sizes), iteration
by iteration. The twin runs Megatron's own no-pipelining schedule, so every part of
Megatron's per-microbatch step (loss normalisation, the MoE auxiliary-loss scale,
the sequence-parallel gradient all-reduce, recompute) is the reference. Tolerance:
fp32 on the CPU; PP alone changes no reduction inside a layer (allowed 1e-6
relative, observed bitwise); where tensor or expert parallelism differ between the two
layouts' ranks, reductions may round differently: 1e-5. Negative control: the same
comparison against synchronous training fails (the delay is visible).
"""

import json
import math

import pytest

from tests.support.launch import torchrun_megatron

ITERS = 6
MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--untie-embeddings-and-output-weights", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--layout-invariant-init", "--train-iters", str(ITERS), "--lr", "2e-3", "--log-interval", "1",
         "--eval-interval", "1000", "--eval-iters", "1", "--mock-data", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "256", "--num-workers", "0", "--rerun-mode", "disabled"]
TWIN = ["--simulated-delay", "1", "--simulated-pipeline-stages", "2"]
TWO_BW = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw"]
# (biases off, as in Megatron-LM's MoE examples: with expert biases and no tensor or
# expert parallelism, megatron-core 0.19.2's local expert adds the bias in place on a
# view autograd forbids)
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01",
       "--moe-token-dispatcher-type", "alltoall", "--disable-bias-linear"]

# name: (flags, ranks of the twin (2bw has twice as many), relative tolerance)
FEATURES = {
    "rope, swiglu, rmsnorm, gqa": (["--position-embedding-type", "rope", "--swiglu", "--normalization", "RMSNorm",
                                    "--group-query-attention", "--num-query-groups", "2",
                                    "--disable-bias-linear"], 1, 1e-6),
    "tp2 with sequence parallel": (["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2, 1e-5),
    "full recompute": (["--recompute-granularity", "full", "--recompute-method", "uniform",
                        "--recompute-num-layers", "1"], 1, 1e-6),
    "selective recompute": (["--recompute-granularity", "selective"], 1, 1e-6),
    "moe, aux loss, ep2": (MOE + ["--expert-model-parallel-size", "2"], 2, 1e-5),
    "moe with muon, ep2": (MOE + ["--expert-model-parallel-size", "2", "--optimizer", "muon"], 2, 1e-5),
}


def _losses(tmp_path, name, nproc, flags):
    metrics = tmp_path / f"{name}.jsonl"
    proc = torchrun_megatron(MODEL + flags + ["--metrics-json", metrics], nproc=nproc, timeout_s=400)
    assert proc.returncode == 0, proc.stdout[-5000:]
    losses = [r["lm_loss"] for r in map(json.loads, metrics.read_text().splitlines()) if "lm_loss" in r]
    assert len(losses) == ITERS and all(math.isfinite(x) for x in losses), losses
    return losses


def _differences(a, b, rtol):
    return [(i, x, y) for i, (x, y) in enumerate(zip(a, b), 1) if abs(x - y) > rtol * abs(y)]


@pytest.mark.parametrize("feature", list(FEATURES))
def test_2bw_equals_its_twin(tmp_path, feature):
    flags, nproc, rtol = FEATURES[feature]
    twin = _losses(tmp_path, "twin", nproc, flags + TWIN)
    two_bw = _losses(tmp_path, "2bw", 2 * nproc, flags + TWO_BW)
    assert not _differences(two_bw, twin, rtol), _differences(two_bw, twin, rtol)
    if feature.startswith(("moe, aux", "tp2")):  # negative control
        sync = _losses(tmp_path, "sync", nproc, flags)
        assert _differences(two_bw, sync, rtol)


def _first_step_val_loss(tmp_path, name, flags):
    """The validation loss after one step: both schedules took their first gradient at
    the initial weights, so 2bw and 1F1B must agree there (the delay acts from step 2)."""
    metrics = tmp_path / f"{name}.jsonl"
    args = [a for a in MODEL] + flags + ["--metrics-json", metrics]
    args[args.index("--train-iters") + 1] = "1"
    args[args.index("--eval-interval") + 1] = "1"
    proc = torchrun_megatron(args, nproc=2, timeout_s=400)
    assert proc.returncode == 0, proc.stdout[-5000:]
    (val,) = [r["val_loss"] for r in map(json.loads, metrics.read_text().splitlines()) if "val_loss" in r]
    return val


def test_moe_aux_loss_weighs_the_same_under_2bw_and_1f1b(tmp_path):
    """Megatron's 1F1B scales the MoE auxiliary loss by 1/m per microbatch; so must 2bw.
    Negative control: 2bw with the coefficient m times larger (what a missing scale
    would do, m = 4 here) gives another loss."""
    pp2 = ["--pipeline-model-parallel-size", "2"]  # clipping off: 1F1B clips by the global norm, 2bw per stage
    flags = MOE + ["--lr", "2e-2", "--clip-grad", "0"]
    one_f_one_b = _first_step_val_loss(tmp_path, "1f1b", flags + pp2)
    two_bw = _first_step_val_loss(tmp_path, "2bw", flags + TWO_BW)
    assert abs(two_bw - one_f_one_b) <= 1e-6 * abs(one_f_one_b), (two_bw, one_f_one_b)
    heavier = [a if a != "0.01" else "0.04" for a in flags]
    unscaled = _first_step_val_loss(tmp_path, "unscaled", heavier + TWO_BW)
    assert abs(unscaled - one_f_one_b) > 1e-6 * abs(one_f_one_b), (unscaled, one_f_one_b)

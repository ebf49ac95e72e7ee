"""The stash starts from the weights training starts from, after any load.

The stash copies the weights when the optimizer is built, before Megatron loads a
checkpoint. Unless the checkpoint gave the stash back, both weight versions must be
the loaded weights at the first step. So the first iteration's loss and gradient
norm of a delayed run equal those of the same start under `--simulated-delay 0`
(1e-6 relative, tests/support/loop_runs.py's RTOL: both take the gradient at the loaded
weights), for --finetune, --no-load-optim, --pretrained-checkpoint, a checkpoint
without a stash (Megatron's 1F1B) and a fresh start, under each delay correction,
at PP=1 (--simulated-delay 1) and under 2bw at PP=2. Each start that loads says so.
Negative control: a start that keeps a stash already at the run's iteration instead of
following the load trains the first iteration of --finetune with weight prediction on
the untrained weights. (Without prediction the first step reads version 0 from the live
weights, so such a start goes wrong only there; every case here still runs.)
"""

import json

import pytest
from tests.support.loop_runs import RTOL, run

SAVED_AT = 2
PP2 = ["--pipeline-model-parallel-size", "2"]
NOTICE = "both weight versions start equal, at the loaded weights"


def _first(metrics) -> dict:
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return next(r for r in records if "lm_loss" in r)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A synchronous and a delayed checkpoint at iteration SAVED_AT, at PP=1 and PP=2."""
    root = tmp_path_factory.mktemp("starts")
    made = {}
    for name, nproc, extra in (("sync", 1, []), ("delayed", 1, ["--simulated-delay", "1"]),
                               ("sync_pp2", 2, PP2)):
        ckpt = root / name
        proc, _ = run(root, f"make_{name}", nproc, extra + ["--train-iters", str(SAVED_AT + 1), "--save", str(ckpt),
                                                            "--save-interval", str(SAVED_AT),
                                                            "--exit-interval", str(SAVED_AT)])
        assert proc.returncode == 0, proc.stdout[-4000:]
        made[name] = ckpt
    return made


def _start(ckpt, how, tmp_path):
    """Flags of a start `how` from `ckpt`; the run trains one iteration."""
    if how == "fresh":
        return ["--train-iters", "1"]
    if how == "pretrained":
        return ["--pretrained-checkpoint", str(ckpt), "--load", str(tmp_path / "empty"), "--train-iters", "1"]
    if how == "1f1b checkpoint":
        return ["--load", str(ckpt), "--train-iters", str(SAVED_AT + 1)]
    return ["--load", str(ckpt), f"--{how}", "--train-iters", str(SAVED_AT + 1 if how == "no-load-optim" else 1)]


# (start, checkpoint, correction): every start, every correction at least once
CASES = [("finetune", "sync", "predict"), ("finetune", "delayed", "ef"), ("no-load-optim", "delayed", "dc-asgd"),
         ("pretrained", "sync", "nesterov"), ("1f1b checkpoint", "sync", None), ("fresh", "sync", "predict")]


@pytest.mark.parametrize("how,source,correction", CASES)
def test_a_delayed_start_begins_at_the_loaded_weights(how, source, correction, checkpoints, tmp_path):
    start = _start(checkpoints[source], how, tmp_path)
    proc, reference = run(tmp_path, "reference", 1, start)
    assert proc.returncode == 0, proc.stdout[-4000:]
    corrected = ["--delay-correction", correction] if correction else []
    proc, delayed = run(tmp_path, "delayed", 1, start + ["--simulated-delay", "1"] + corrected)
    assert proc.returncode == 0, proc.stdout[-4000:]
    ref, got = _first(reference), _first(delayed)
    assert got["iteration"] == ref["iteration"]
    for key in ("lm_loss", "grad_norm"):
        assert abs(got[key] - ref[key]) <= RTOL * abs(ref[key]), (key, got, ref)
    assert (NOTICE in proc.stdout) == (how != "fresh"), proc.stdout[-3000:]


def test_2bw_finetune_with_prediction_begins_at_the_loaded_weights(checkpoints, tmp_path):
    """The reported case: --finetune --delay-correction predict under 2bw at PP=2, against
    Megatron's 1F1B from the same checkpoint (the same loss; its gradient norm is over
    both stages, 2bw's over its own stage, so the loss is what is compared)."""
    start = _start(checkpoints["sync_pp2"], "finetune", tmp_path) + PP2
    proc, reference = run(tmp_path, "reference", 2, start)
    assert proc.returncode == 0, proc.stdout[-4000:]
    two_bw = start + ["--pipeline-schedule", "2bw", "--delay-correction", "predict"]
    proc, fixed = run(tmp_path, "fixed", 2, two_bw)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert NOTICE in proc.stdout and "--finetune" in proc.stdout, proc.stdout[-3000:]
    ref = _first(reference)["lm_loss"]
    assert abs(_first(fixed)["lm_loss"] - ref) <= RTOL * abs(ref)
    # negative control: a start that keeps the stash at the run's iteration holds untrained weights
    proc, former = run(tmp_path, "former", 2, two_bw, module="tests.support.step_end_entry",
                       env={"MEGATRON_ASYNC_TEST_OLD_STASH_START": "1"})
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert abs(_first(former)["lm_loss"] - ref) > RTOL * abs(ref)

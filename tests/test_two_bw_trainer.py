"""`--pipeline-schedule 2bw` and `--simulated-delay` in megatron-async-pretrain."""

import json

import pytest

from megatron_async.pretrain_gpt import main
from megatron_async.testing.launch import torchrun_pretrain

MODEL = ["--mock-data", "--vocab-size", "500", "--num-layers", "2", "--hidden-size", "64",
         "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--untie-embeddings-and-output-weights", "--log-interval", "4", "--eval-interval", "6",
         "--eval-iters", "2"]
TWO_BW = MODEL + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw"]


def _records(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _by_iteration(records, key):
    return {r["iteration"]: r[key] for r in records if key in r}


def test_2bw_resume_after_save_equals_uninterrupted(tmp_path):
    full, resumed, ckpt = tmp_path / "full.jsonl", tmp_path / "resumed.jsonl", tmp_path / "ckpt"
    run = torchrun_pretrain(TWO_BW + ["--train-iters", "12", "--save", ckpt, "--save-interval", "6",
                                      "--metrics-json", full], nproc=2, timeout_s=300)
    assert run.returncode == 0, run.stdout[-4000:]
    (ckpt / "latest_checkpointed_iteration.txt").write_text("6")
    run = torchrun_pretrain(TWO_BW + ["--train-iters", "12", "--load", ckpt, "--metrics-json", resumed],
                            nproc=2, timeout_s=300)
    assert run.returncode == 0, run.stdout[-4000:]
    assert "resumed from" in run.stdout
    a, b = _records(full), _records(resumed)
    losses_a, losses_b = _by_iteration(a, "lm_loss"), _by_iteration(b, "lm_loss")
    assert sorted(losses_b) == list(range(7, 13))
    # fp32 on CPU, same operations in the same order: equal to round-off (observed: bitwise).
    for it in range(7, 13):
        assert losses_b[it] == pytest.approx(losses_a[it], rel=1e-6, abs=0), it
    assert _by_iteration(b, "val_loss")[12] == pytest.approx(_by_iteration(a, "val_loss")[12], rel=1e-6)


def test_simulated_delay_zero_is_plain_training(tmp_path):
    plain, zero = tmp_path / "plain.jsonl", tmp_path / "zero.jsonl"
    for path, extra in ((plain, []), (zero, ["--simulated-delay", "0"])):
        run = torchrun_pretrain(MODEL + ["--train-iters", "4", "--metrics-json", path] + extra, nproc=1, timeout_s=200)
        assert run.returncode == 0, run.stdout[-4000:]
    strip = lambda recs: [{k: v for k, v in r.items() if k not in ("s_per_iter", "tokens_per_s")} for r in recs]
    assert strip(_records(plain)) == strip(_records(zero))



def _train_losses(tmp_path, name, args, nproc):
    path = tmp_path / f"{name}.jsonl"
    run = torchrun_pretrain(args + ["--train-iters", "8", "--metrics-json", path], nproc=nproc, timeout_s=300)
    assert run.returncode == 0, run.stdout[-4000:]
    return _by_iteration(_records(path), "lm_loss"), _by_iteration(_records(path), "val_loss")


def test_2bw_in_the_trainer_equals_its_simulated_delay_twin(tmp_path):
    """With --layout-invariant-init both layouts start equal; 2bw PP=2 then follows
    PP=1 --simulated-delay 1 (with stage-local clipping of the same 2 stages, and a
    clip small enough to act) step by step, and is not the synchronous run."""
    common = MODEL + ["--layout-invariant-init", "--clip-grad", "0.1", "--lr", "3e-3"]
    twin = _train_losses(tmp_path, "twin", common + ["--simulated-delay", "1", "--simulated-pipeline-stages", "2"], 1)
    two_bw = _train_losses(tmp_path, "2bw", common + TWO_BW[len(MODEL):], 2)
    sync = _train_losses(tmp_path, "sync", common, 1)
    assert sorted(two_bw[0]) == list(range(1, 9))
    # fp32 on CPU; the pipelined run splits the model across processes, so sums
    # may round differently: per-iteration losses to 1e-5 relative.
    for it in range(1, 9):
        assert two_bw[0][it] == pytest.approx(twin[0][it], rel=1e-5, abs=0), it
    assert two_bw[1][6] == pytest.approx(twin[1][6], rel=1e-5, abs=0)
    assert max(abs(sync[0][it] - twin[0][it]) for it in range(3, 9)) > 1e-4  # the delay is visible


def test_stage_delay_list_in_the_trainer(tmp_path):
    """`--simulated-delay 1,1` is `--simulated-delay 1 --simulated-pipeline-stages 2`;
    `1,0` (the last stage current) is another trajectory. Exactness of per-stage
    delays against an independent reference: tests/test_stage_delays.py."""
    common = MODEL + ["--clip-grad", "0.1", "--lr", "3e-3"]
    listed = _train_losses(tmp_path, "listed", common + ["--simulated-delay", "1,1"], 1)
    twin = _train_losses(tmp_path, "twin", common + ["--simulated-delay", "1", "--simulated-pipeline-stages", "2"], 1)
    mixed = _train_losses(tmp_path, "mixed", common + ["--simulated-delay", "1,0"], 1)
    assert listed == twin
    assert max(abs(mixed[0][it] - twin[0][it]) for it in range(3, 9)) > 1e-5


REFUSALS = {
    "tied embeddings": ([a for a in TWO_BW if a != "--untie-embeddings-and-output-weights"], 2,
                        "--untie-embeddings-and-output-weights"),
    "per-token loss": (TWO_BW + ["--calculate-per-token-loss"], 2, "--calculate-per-token-loss"),
    "fp16 loss scaling": (TWO_BW + ["--fp16"], 2, "--fp16"),
    "too few microbatches": (MODEL + ["--pipeline-model-parallel-size", "4", "--num-layers", "4",
                                      "--pipeline-schedule", "2bw", "--global-batch-size", "4"], 4,
                             "at least 3 microbatches"),
    "simulated delay with pipelining": (MODEL + ["--pipeline-model-parallel-size", "2", "--simulated-delay", "1"],
                                        2, "--simulated-delay"),
    "stage delays that do not split the layers": (MODEL + ["--simulated-delay", "1,0,0"], 1, "--simulated-delay"),
    "stage delays vs stages": (MODEL + ["--simulated-delay", "1,0", "--simulated-pipeline-stages", "1"], 1,
                               "lists 2 stage delays"),
    "simulation-only schedule": (MODEL + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "gpipe"],
                                 2, "can only be simulated"),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_2bw_refusals_before_training(name, monkeypatch, capsys):
    argv, world, needle = REFUSALS[name]
    monkeypatch.setenv("WORLD_SIZE", str(world))
    assert main([str(a) for a in argv] + ["--train-iters", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err

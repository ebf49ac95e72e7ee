"""megatron-async-pretrain end to end on a prepared corpus: real torchrun processes on the CPU.

Each run is a tiny GPT (2 layers, hidden 64) for 20 iterations on the `small_corpus`
fixture (stdlib documentation, 400-token vocabulary), so the whole file takes
about two minutes on 2 cores.
"""

import json
import math
import re
import shutil
from types import SimpleNamespace

import pytest

from megatron_async.testing.launch import torchrun_pretrain

ITERS = 20
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(ITERS),
         "--lr", "3e-3", "--lr-warmup-iters", "2", "--log-interval", "5", "--eval-interval", "5",
         "--eval-iters", "2"]
ITERATION_KEYS = {"iteration", "lm_loss", "lr", "grad_norm", "s_per_iter", "tokens_per_s"}
RUN_TIMEOUT_S = 300
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _data_args(corpus):
    return ["--train-data-path", corpus / "train_text_document", "--valid-data-path", corpus / "valid_text_document",
            "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", corpus / "tokenizer.model"]


def _train(tmp_path, corpus, extra, nproc=2, name="run"):
    """One run writing NAME.jsonl and NAME.png under tmp_path; fails the test on a non-zero exit."""
    metrics, plot = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.png"
    args = MODEL + _data_args(corpus) + ["--data-cache-path", tmp_path / "cache", "--metrics-json", metrics,
                                         "--plot", plot] + extra
    proc = torchrun_pretrain(args, nproc=nproc, timeout_s=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-5000:]
    return SimpleNamespace(stdout=proc.stdout, metrics=metrics, plot=plot)


def _records(path):
    """The metrics file: every line one JSON object, either an iteration or an evaluation record."""
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        record = json.loads(line)
        assert isinstance(record, dict), f"line {number}: {line}"
        if "val_loss" in record:
            assert set(record) == {"iteration", "val_loss"}, record
            assert math.isfinite(record["val_loss"])
        else:
            assert ITERATION_KEYS <= set(record), record
            for key in ITERATION_KEYS - {"iteration"}:
                assert isinstance(record[key], float) and math.isfinite(record[key]), (key, record)
        records.append(record)
    return records


def _by_iteration(records, key):
    found = [(r["iteration"], r[key]) for r in records if key in r]
    assert len(found) == len(dict(found)), f"an iteration logged {key} twice"
    return dict(found)


def _check_run(run, first=1):
    """Iterations first..ITERS each logged once, evaluations every 5, plot and summary line written."""
    records = _records(run.metrics)
    losses = _by_iteration(records, "lm_loss")
    assert sorted(losses) == list(range(first, ITERS + 1))
    vals = _by_iteration(records, "val_loss")
    assert sorted(vals) == [i for i in range(5, ITERS + 1, 5) if i >= first]

    assert run.plot.read_bytes()[:8] == PNG_SIGNATURE
    import matplotlib.image

    assert matplotlib.image.imread(str(run.plot)).ndim == 3  # decodes as an image
    last = run.stdout.strip().splitlines()[-1]
    match = re.search(r"done after 20 iterations; final validation loss ([0-9.]+); loss plot: (\S+)", last)
    assert match, last
    assert float(match.group(1)) == pytest.approx(vals[ITERS], abs=1e-4) and match.group(2) == str(run.plot)
    return losses, vals


def _check_learns(run):
    """_check_run, and the mean loss of the last 5 iterations is well below that of the first 5."""
    losses, vals = _check_run(run)
    ordered = [losses[i] for i in sorted(losses)]
    assert sum(ordered[-5:]) / 5 < sum(ordered[:5]) / 5 - 0.3, ordered
    return losses, vals


@pytest.fixture(scope="module")
def pp2_run(small_corpus, tmp_path_factory):
    """PP=2 (1F1B) for 20 iterations, saving checkpoints at 10 and 20."""
    tmp_path = tmp_path_factory.mktemp("pp2")
    ckpt = tmp_path / "ckpt"
    run = _train(tmp_path, small_corpus, ["--pipeline-model-parallel-size", "2", "--save", ckpt,
                                          "--save-interval", "10"])
    run.ckpt = ckpt
    return run


def test_pipeline_parallel_run_learns(pp2_run):
    losses, vals = _check_learns(pp2_run)
    assert "1f1b schedule, world 2 (TP 1 x PP 2 x DP 1)" in pp2_run.stdout
    assert vals[ITERS] < math.log(400)  # better than uniform over the vocabulary


def test_data_parallel_distributed_optimizer_run_learns(small_corpus, tmp_path):
    run = _train(tmp_path, small_corpus, ["--use-distributed-optimizer"])
    assert "world 2 (TP 1 x PP 1 x DP 2)" in run.stdout
    _check_learns(run)


def test_resume_from_iteration_10_equals_uninterrupted(pp2_run, small_corpus, tmp_path):
    # The uninterrupted run saved at 10 and 20; make 10 the latest, as if it had stopped there.
    ckpt = tmp_path / "ckpt"
    shutil.copytree(pp2_run.ckpt / "iter_0000010", ckpt / "iter_0000010")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("10")
    run = _train(tmp_path, small_corpus, ["--pipeline-model-parallel-size", "2", "--load", ckpt], name="resumed")
    assert "resumed from" in run.stdout and "iteration 10" in run.stdout
    losses, vals = _check_run(run, first=11)
    full = _records(pp2_run.metrics)
    full_losses, full_vals = _by_iteration(full, "lm_loss"), _by_iteration(full, "val_loss")
    # fp32 on the CPU, same data, RNG and reduction order: equal to round-off (observed: bitwise).
    for it in range(11, ITERS + 1):
        assert losses[it] == pytest.approx(full_losses[it], rel=1e-6, abs=0), it
    for it in vals:
        assert vals[it] == pytest.approx(full_vals[it], rel=1e-6, abs=0), it

"""2bw in Megatron's own loop on a prepared corpus: real torchrun processes on the CPU.

A tiny GPT (2 layers, hidden 64, Megatron's default dropout 0.1) trains 20
iterations with Muon at PP=2 on the `small_corpus` fixture (stdlib documentation,
SentencePiece BPE with 400 tokens, Megatron indexed datasets read by Megatron's
GPTDataset). It learns; the metrics file and the loss plot are whole; a run resumed
from the checkpoint of iteration 10 equals the uninterrupted one and its metrics
file covers every iteration once.
"""

import json
import math
import shutil

import pytest

from tests.support.launch import torchrun_megatron

ITERS = 20
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--untie-embeddings-and-output-weights", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--train-iters", str(ITERS), "--optimizer", "muon", "--lr", "3e-3",
         "--lr-warmup-iters", "2", "--log-interval", "5", "--eval-interval", "5", "--eval-iters", "2",
         "--num-workers", "0", "--rerun-mode", "disabled", "--pipeline-model-parallel-size", "2",
         "--pipeline-schedule", "2bw"]
ITERATION_KEYS = {"iteration", "lm_loss", "lr", "grad_norm", "s_per_iter"}
RUN_TIMEOUT_S = 300
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
RTOL = 1e-6  # fp32 on the CPU, same data, RNG and reduction order (observed: bitwise)


def _train(tmp_path, corpus, extra, metrics):
    plot = metrics.with_suffix(".png")
    args = MODEL + ["--train-data-path", corpus / "train_text_document", "--valid-data-path",
                    corpus / "valid_text_document", "--tokenizer-type", "SentencePieceTokenizer",
                    "--tokenizer-model", corpus / "tokenizer.model", "--data-cache-path", tmp_path / "cache",
                    "--metrics-json", metrics, "--plot", plot] + extra
    proc = torchrun_megatron(args, nproc=2, timeout_s=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-5000:]
    return proc.stdout, plot


def _records(path):
    """Every line one JSON object: an iteration record or an evaluation record."""
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    for record in records:
        evaluation = {"val_loss", "final_val_loss"} & set(record)
        if evaluation:
            (key,) = evaluation
            assert set(record) == {"iteration", key} and math.isfinite(record[key]), record
        else:
            assert ITERATION_KEYS <= set(record), record
            assert all(math.isfinite(record[k]) for k in ("lm_loss", "lr", "grad_norm")), record
    return records


def _by_iteration(records, key):
    found = [(r["iteration"], r[key]) for r in records if key in r]
    assert len(found) == len(dict(found)), f"an iteration logged {key} twice: {found}"
    return dict(found)


@pytest.fixture(scope="module")
def full_run(small_corpus, tmp_path_factory):
    """20 iterations, checkpoints at 10 and 20."""
    tmp_path = tmp_path_factory.mktemp("full")
    metrics = tmp_path / "full.jsonl"
    stdout, plot = _train(tmp_path, small_corpus, ["--save", tmp_path / "ckpt", "--save-interval", "10"], metrics)
    return dict(dir=tmp_path, stdout=stdout, plot=plot, records=_records(metrics), metrics=metrics)


def test_2bw_learns_on_the_corpus_and_writes_metrics_and_plot(full_run):
    losses = _by_iteration(full_run["records"], "lm_loss")
    assert sorted(losses) == list(range(1, ITERS + 1))
    vals = _by_iteration(full_run["records"], "val_loss")
    assert sorted(vals) == list(range(5, ITERS + 1, 5))
    assert list(_by_iteration(full_run["records"], "final_val_loss")) == [ITERS]  # Megatron's after training
    ordered = [losses[i] for i in sorted(losses)]
    assert sum(ordered[-5:]) / 5 < sum(ordered[:5]) / 5 - 0.3, ordered
    assert vals[ITERS] < math.log(400)  # better than uniform over the vocabulary
    assert f"iteration       {ITERS}/      {ITERS}" in full_run["stdout"]  # Megatron's own progress line
    # --data-cache-path is keyed by the data's .idx files (megatron_async.data.cache)
    (keyed,) = (full_run["dir"] / "cache").iterdir()
    assert keyed.name.startswith("data-") and any(keyed.iterdir())

    assert full_run["plot"].read_bytes()[:8] == PNG_SIGNATURE
    import matplotlib.image

    assert matplotlib.image.imread(str(full_run["plot"])).ndim == 3  # decodes as an image


def test_resume_from_iteration_10_equals_uninterrupted(full_run, small_corpus, tmp_path):
    """The checkpoint of iteration 10 made the latest, as if the run had died after it;
    the metrics file of the died run (records to 20) is resumed: 11-20 are replaced."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(full_run["dir"] / "ckpt" / "iter_0000010", ckpt / "iter_0000010")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("10")
    metrics = tmp_path / "resumed.jsonl"
    shutil.copy(full_run["metrics"], metrics)
    _train(tmp_path, small_corpus, ["--load", ckpt], metrics)

    records = _records(metrics)
    losses, full = _by_iteration(records, "lm_loss"), _by_iteration(full_run["records"], "lm_loss")
    assert sorted(losses) == list(range(1, ITERS + 1))
    for it in range(11, ITERS + 1):
        assert losses[it] == pytest.approx(full[it], rel=RTOL, abs=0), it
    vals, full_vals = _by_iteration(records, "val_loss"), _by_iteration(full_run["records"], "val_loss")
    assert sorted(vals) == sorted(full_vals)
    vals[0] = _by_iteration(records, "final_val_loss")[ITERS]
    full_vals[0] = _by_iteration(full_run["records"], "final_val_loss")[ITERS]
    for it in vals:
        assert vals[it] == pytest.approx(full_vals[it], rel=RTOL, abs=0), it


def test_resume_check_can_fail(full_run, small_corpus, tmp_path):
    """Negative control: resumed with another --seed (other dropout masks), the same
    comparison fails."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(full_run["dir"] / "ckpt" / "iter_0000010", ckpt / "iter_0000010")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("10")
    metrics = tmp_path / "other_seed.jsonl"
    _train(tmp_path, small_corpus, ["--load", ckpt, "--seed", "7", "--no-load-rng"], metrics)
    losses, full = _by_iteration(_records(metrics), "lm_loss"), _by_iteration(full_run["records"], "lm_loss")
    assert sorted(losses) == list(range(11, ITERS + 1))
    assert any(abs(losses[it] - full[it]) > RTOL * abs(full[it]) for it in range(11, ITERS + 1))

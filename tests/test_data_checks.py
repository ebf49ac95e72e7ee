"""Megatron's loop, with the plugin, refuses datasets that do not belong to its tokenizer, or hold less than one global batch."""

import json
import shutil
import socket

import pytest

from megatron_async.data import prepare
from megatron_async.data.checks import (
    check_enough_tokens,
    check_tokenizer_matches,
    check_training_data,
    max_token_id,
)
from megatron_async.data.errors import DataError
from tests.support.warm_launch import warm_python

@pytest.fixture(scope="module")
def vocab300(tmp_path_factory, text_files):
    """The small corpus's text prepared again with a 300-token vocabulary (small_corpus has 400)."""
    out = tmp_path_factory.mktemp("vocab300") / "prepared"
    prepare(str(out), corpus=None, inputs=text_files, vocab_size=300, valid_fraction=0.2, seed=1234)
    return out


def _data(folder, tokenizer_folder=None):
    return ["--train-data-path", str(folder / "train_text_document"),
            "--valid-data-path", str(folder / "valid_text_document"),
            "--tokenizer-model", str((tokenizer_folder or folder) / "tokenizer.model")]


def test_matching_pair_passes(small_corpus):
    check_training_data([str(small_corpus / "train_text_document")], [str(small_corpus / "valid_text_document")],
                        str(small_corpus / "tokenizer.model"), seq_length=32, global_batch_size=8)


@pytest.mark.parametrize("data_vocab, tokenizer_vocab", [(400, 300), (300, 400)])
def test_other_tokenizer_is_refused_naming_both(small_corpus, vocab300, data_vocab, tokenizer_vocab):
    """Either way round: more ids than the tokenizer knows (the late IndexError), or fewer (silent garbage)."""
    folders = {400: small_corpus, 300: vocab300}
    prefix, model = folders[data_vocab] / "valid_text_document", folders[tokenizer_vocab] / "tokenizer.model"
    with pytest.raises(DataError) as err:
        check_training_data([str(folders[data_vocab] / "train_text_document")], [str(prefix)], str(model), 32, 8)
    message = str(err.value)
    assert "another tokenizer" in message and str(model) in message
    assert str(folders[data_vocab] / "train_text_document") in message  # the train split is checked first


def test_dataset_without_stats_is_checked_by_token_ids(small_corpus, vocab300, tmp_path):
    """Data made elsewhere (e.g. Megatron-LM's preprocess_data.py) has no fingerprint to compare."""
    for ext in ("bin", "idx"):
        shutil.copy(small_corpus / f"train_text_document.{ext}", tmp_path / f"train_text_document.{ext}")
    prefix = str(tmp_path / "train_text_document")
    check_tokenizer_matches([prefix], str(small_corpus / "tokenizer.model"))  # ids < 400: accepted
    with pytest.raises(DataError) as err:
        check_tokenizer_matches([prefix], str(vocab300 / "tokenizer.model"))
    assert prefix in str(err.value) and str(vocab300 / "tokenizer.model") in str(err.value)
    assert "vocabulary of 300" in str(err.value)
    largest = max_token_id(prefix)
    check_tokenizer_matches([prefix], None, vocab_size=largest + 1)  # e.g. a NullTokenizer's --vocab-size
    with pytest.raises(DataError, match=f"holds token id {largest}, but --vocab-size has a vocabulary of {largest}"):
        check_tokenizer_matches([prefix], None, vocab_size=largest)


def test_folder_whose_stats_disagree_with_its_data_is_refused(small_corpus, tmp_path):
    folder = tmp_path / "mixed"
    shutil.copytree(small_corpus, folder)
    stats = json.loads((folder / "stats.json").read_text())
    stats["splits"]["train"]["tokens"] += 1
    (folder / "stats.json").write_text(json.dumps(stats))
    with pytest.raises(DataError, match="inconsistent"):
        check_tokenizer_matches([str(folder / "train_text_document")], str(folder / "tokenizer.model"))


def test_less_than_one_global_batch_is_refused_with_the_numbers(small_corpus):
    prefix = str(small_corpus / "train_text_document")
    tokens = json.loads((small_corpus / "stats.json").read_text())["splits"]["train"]["tokens"]
    assert check_enough_tokens([prefix], seq_length=tokens - 1, global_batch_size=1) == tokens  # exactly enough
    with pytest.raises(DataError) as err:
        check_enough_tokens([prefix], seq_length=tokens, global_batch_size=1)
    message = str(err.value)
    assert f"{tokens:,} tokens" in message and f"--seq-length {tokens}" in message
    assert "--global-batch-size 1" in message and f"{tokens + 1:,}" in message


def test_megatrons_loop_refuses_mismatched_tokenizer_before_any_process_group(small_corpus, vocab300):
    """The same refusal in Megatron's own loop (launcher, Megatron's argument validation), as
    rank 1 of 2 with no rank 0: it exits 2 at once, naming dataset and tokenizer."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port))
    args = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--micro-batch-size", "2",
            "--global-batch-size", "8", "--train-iters", "2", "--seq-length", "32", "--max-position-embeddings", "32",
            "--eval-interval", "10", "--lr", "1e-3", "--tokenizer-type", "SentencePieceTokenizer"]
    args += _data(small_corpus, tokenizer_folder=vocab300)
    proc = warm_python("megatron_async.launch", ["--gpt", *args], 120, env=env)  # one process, Megatron imported
    assert proc.returncode == 2, proc.stdout[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("megatron-async: error:")]
    assert len(lines) == 1 and "--train-data-path" in lines[0], proc.stdout[-3000:]
    assert str(small_corpus / "train_text_document") in lines[0] and str(vocab300 / "tokenizer.model") in lines[0]


@pytest.mark.parametrize("flag", ["--data-path", "--train-data-path"])
def test_a_refusal_names_the_flag_the_data_came_from(small_corpus, vocab300, flag):
    """Megatron's argument check (data/flag_checks.py) with a blend given by --data-path names
    --data-path, not --train-data-path."""
    from types import SimpleNamespace

    from megatron_async.megatron_lm.adapter.flags import FlagError, _check_data

    prefix = str(small_corpus / "train_text_document")
    args = SimpleNamespace(mock_data=False, train_data_path=[prefix] if flag == "--train-data-path" else None,
                           data_path=[prefix] if flag == "--data-path" else None, valid_data_path=None,
                           tokenizer_type="SentencePieceTokenizer", tokenizer_model=str(vocab300 / "tokenizer.model"),
                           seq_length=32, global_batch_size=8, vocab_size=None)
    with pytest.raises(FlagError) as err:
        _check_data(args)
    assert f"{flag} " in str(err.value) or f"{flag}:" in str(err.value), str(err.value)

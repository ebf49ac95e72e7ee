"""Before training: do the datasets belong to the tokenizer, and are they big enough?

Without these checks a mismatched tokenizer/dataset pair either trains silently on garbage or
crashes with an IndexError after all of training, at the first evaluation, and a corpus
smaller than one batch trains on the same few tokens over and over without a word.

Everything here reads only the tokenizer file, `stats.json` and the .idx files (plus, for
datasets not made by prepare-data, a bounded scan of the .bin), takes plain paths and numbers,
and needs no process group: our trainer calls `check_training_data` from `main()` on every
rank before any collective, and a Megatron-LM training loop can call it the same way.
Problems raise DataError with a one-line message naming the flags and paths.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

import numpy

from megatron_async.data.corpus import sha256_of
from megatron_async.data.errors import DataError

FULL_SCAN_BYTES = 64 << 20  # .bin files up to 64 MiB are scanned whole for the largest token id (every rank reads it)
SAMPLE_WINDOWS, SAMPLE_WINDOW_BYTES = 64, 1 << 20  # larger ones: 64 evenly spaced 1 MiB windows


def _indexed(prefix: str, flag: str):
    """Megatron's IndexedDataset for `prefix`, or DataError when the .idx is not one."""
    from megatron_async.data.indexed import quiet_megatron_import

    try:
        return quiet_megatron_import().IndexedDataset(prefix)
    except (AssertionError, ValueError, OSError, KeyError, IndexError) as exc:
        raise DataError(f"{flag} {prefix}: {prefix}.idx is not a Megatron indexed dataset ({exc})") from None


def count_tokens(prefix: str, flag: str = "dataset") -> int:
    """Tokens in the dataset at `prefix` (EOD tokens included), from the sequence lengths in its .idx."""
    ds = _indexed(prefix, flag)  # kept alive while its arrays are read: deleting it unmaps the .idx
    return int(ds.sequence_lengths.sum(dtype=numpy.int64))


def _prepared_stats(prefix: str) -> Optional[tuple[Path, dict]]:
    """(stats.json path, its entry for this split) when prepare-data made `prefix`; else None."""
    path = Path(prefix).parent / "stats.json"
    try:
        stats = json.loads(path.read_text())
        split = next(s for s in stats["splits"].values() if s["prefix"] == Path(prefix).name)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, StopIteration):
        return None
    return path, {**split, "tokenizer_sha256": (stats.get("tokenizer") or {}).get("sha256")}


def max_token_id(prefix: str, flag: str = "dataset") -> int:
    """Largest token id in `prefix`.bin: a full scan up to FULL_SCAN_BYTES, evenly spaced windows beyond.

    A dataset tokenized with another vocabulary has out-of-range ids all through it, so the
    windows find them; the scan never reads more than 64 MiB per rank.
    """
    ds = _indexed(prefix, flag)
    dtype = numpy.dtype(ds.index.dtype)
    bin_path = Path(prefix + ".bin")
    size = bin_path.stat().st_size
    if len(ds.sequence_lengths):
        needed = int(ds.index.sequence_pointers[-1]) + int(ds.sequence_lengths[-1]) * dtype.itemsize
        if size < needed:
            raise DataError(f"{flag} {prefix}: {bin_path} holds {size:,} bytes but its .idx needs {needed:,}; "
                            "the .bin and .idx do not belong together (re-run megatron-async-prepare-data)")
    count = size // dtype.itemsize
    if count == 0:
        return -1
    tokens = numpy.memmap(bin_path, dtype=dtype, mode="r", shape=(count,))
    if size <= FULL_SCAN_BYTES:
        return int(tokens.max())
    window = SAMPLE_WINDOW_BYTES // dtype.itemsize
    starts = numpy.linspace(0, count - window, SAMPLE_WINDOWS, dtype=numpy.int64)
    return max(int(tokens[s:s + window].max()) for s in starts)


def _tokenizer_vocab_size(tokenizer_model: str) -> int:
    import sentencepiece as spm

    try:
        return spm.SentencePieceProcessor(model_file=str(tokenizer_model)).get_piece_size()
    except (OSError, RuntimeError) as exc:
        raise DataError(f"--tokenizer-model {tokenizer_model}: not a SentencePiece model ({exc})") from None


def _fingerprint_verified(prefix: str, tokenizer_model: Optional[str], digest: Optional[str], flag: str) -> bool:
    """True when prepare-data's stats.json vouches for `prefix` with this tokenizer; raises on a mismatch.

    False when there is nothing to compare: no stats.json of ours, one from before the
    fingerprint (format 1), or no tokenizer model (e.g. NullTokenizer).
    """
    prepared = _prepared_stats(prefix)
    if prepared is None:
        return False
    stats_path, split = prepared
    tokens = count_tokens(prefix, flag)
    if tokens != split.get("tokens"):
        raise DataError(f"{flag} {prefix}: its .idx holds {tokens:,} tokens but {stats_path} records "
                        f"{split.get('tokens')}; the folder is inconsistent (re-run megatron-async-prepare-data)")
    recorded = split["tokenizer_sha256"]
    if not (digest and recorded):
        return False
    if recorded != digest:
        raise DataError(
            f"{flag} {prefix} was tokenized with another tokenizer than --tokenizer-model {tokenizer_model} "
            f"(sha256 {recorded[:12]}... in {stats_path}, the model's is {digest[:12]}...); "
            f"pass the tokenizer.model prepared with it ({stats_path.parent / 'tokenizer.model'})")
    return True


def check_tokenizer_matches(
    prefixes: Sequence[str],
    tokenizer_model: Optional[str],
    vocab_size: Optional[int] = None,
    flag: str = "--train-data-path",
) -> None:
    """Refuse datasets that were not tokenized with `tokenizer_model` (or hold ids >= `vocab_size`).

    Datasets made by prepare-data record their tokenizer's SHA-256 in stats.json, which must
    equal that of `tokenizer_model`. Others (e.g. Megatron-LM's preprocess_data.py output, or
    stats.json from before the fingerprint) have nothing to compare, so their largest token id
    is checked against the vocabulary size instead (`vocab_size`, default: the model's).
    """
    digest = sha256_of(Path(tokenizer_model)) if tokenizer_model else None
    for prefix in map(str, prefixes):
        if _fingerprint_verified(prefix, tokenizer_model, digest, flag):
            continue
        bound = vocab_size if vocab_size is not None else (
            _tokenizer_vocab_size(tokenizer_model) if tokenizer_model else None)
        if bound is None:
            continue
        largest = max_token_id(prefix, flag)
        if largest >= bound:
            source = f"--tokenizer-model {tokenizer_model}" if tokenizer_model else "--vocab-size"
            raise DataError(f"{flag} {prefix} holds token id {largest}, but {source} has a vocabulary of {bound}: "
                            "the dataset was tokenized with another tokenizer")


def check_enough_tokens(
    prefixes: Sequence[str], seq_length: int, global_batch_size: int, flag: str = "--train-data-path"
) -> int:
    """Refuse a split with fewer tokens than one global batch of sequences; return its token count.

    One global batch needs global_batch_size * seq_length + 1 tokens (each sample reads one
    token past its sequence for the labels). Anything less is repeated within the very first
    batch, which GPTDataset does without a word.
    """
    tokens = sum(count_tokens(str(p), flag) for p in prefixes)
    needed = global_batch_size * seq_length + 1
    if tokens < needed:
        names = " ".join(map(str, prefixes))
        raise DataError(f"{flag} {names} holds {tokens:,} tokens, fewer than one global batch needs: "
                        f"--global-batch-size {global_batch_size} x --seq-length {seq_length} + 1 = {needed:,}; "
                        "use more text or lower --global-batch-size / --seq-length")
    return tokens


def check_training_data(
    train_prefixes: Sequence[str],
    valid_prefixes: Optional[Sequence[str]],
    tokenizer_model: Optional[str],
    seq_length: int,
    global_batch_size: int,
    vocab_size: Optional[int] = None,
    train_flag: str = "--train-data-path",
) -> None:
    """All checks for a training run (flags named as in Megatron-LM); raises DataError.

    `tokenizer_model` is the SentencePiece model, or None with `vocab_size` for other tokenizers.
    `train_flag`: the flag the training prefixes came from (--data-path for a blend).
    """
    for flag, prefixes in ((train_flag, train_prefixes), ("--valid-data-path", valid_prefixes)):
        if prefixes:
            check_tokenizer_matches(prefixes, tokenizer_model, vocab_size, flag)
            check_enough_tokens(prefixes, seq_length, global_batch_size, flag)

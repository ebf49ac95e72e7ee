"""The training data a command line names, checked before Megatron reads it.

Indexed datasets (`--data-path`, `--train-data-path`, `--valid-data-path`) against the
tokenizer (`--tokenizer-model`) and one global batch; raises DataError, which the
flag checks turn into the one-line refusal.
"""

from __future__ import annotations

import glob
import os

from megatron_async.data.checks import check_training_data
from megatron_async.data.errors import DataError


def _prefixes(paths) -> list[str]:
    """Dataset prefixes of a Megatron path list ("[weight] prefix ..."; weights are numbers)."""
    out = []
    for item in paths or []:
        try:
            float(item)
        except ValueError:
            out.append(item)
    return out


def check_data_flags(args) -> None:
    """Datasets against the tokenizer and one global batch (megatron_async.data.checks),
    for indexed datasets given by --data-path or --train/valid-data-path; raises DataError."""
    if args.mock_data:
        return
    train = _prefixes(args.train_data_path) or _prefixes(args.data_path)
    if not train:
        return
    sentencepiece = args.tokenizer_type == "SentencePieceTokenizer"
    if sentencepiece and args.tokenizer_model and os.path.isdir(args.tokenizer_model):
        inside = sorted(glob.glob(os.path.join(args.tokenizer_model, "*.model")))
        raise DataError(f"--tokenizer-model {args.tokenizer_model} is a directory; --tokenizer-type "
                        "SentencePieceTokenizer needs the model file itself"
                        + (f", e.g. --tokenizer-model {inside[0]}" if inside else
                           " (a .model file, as megatron-async-prepare-data writes tokenizer.model)"))
    if sentencepiece and not (args.tokenizer_model is not None and os.path.isfile(args.tokenizer_model)):
        raise DataError(f"--tokenizer-model {args.tokenizer_model}: no such file (needed by --tokenizer-type "
                        "SentencePieceTokenizer)")
    check_training_data(train, _prefixes(args.valid_data_path) or None,
                        args.tokenizer_model if sentencepiece else None, args.seq_length,
                        args.global_batch_size, vocab_size=None if sentencepiece else args.vocab_size,
                        train_flag="--train-data-path" if _prefixes(args.train_data_path) else "--data-path")

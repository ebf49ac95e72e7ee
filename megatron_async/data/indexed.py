"""Writing token documents as Megatron indexed datasets (`PREFIX.bin` + `PREFIX.idx`).

Written with Megatron-Core's own IndexedDatasetBuilder, so GPTDataset reads the
files exactly as it reads those of Megatron-LM's preprocess_data.py: one sequence
per document, each document ending with the tokenizer's EOD token.
"""

from __future__ import annotations

import importlib
import logging
import warnings
from typing import Iterable

import numpy


def quiet_import(module: str):
    """Import a megatron.core module without its Transformer-Engine/Apex/CUDA warnings.

    Those concern training kernels, not data files, and would bury the progress lines.
    """
    cpp_logger = logging.getLogger("torch.utils.cpp_extension")
    level = cpp_logger.level
    cpp_logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.import_module(module)
    finally:
        cpp_logger.setLevel(level)


def quiet_megatron_import():
    return quiet_import("megatron.core.datasets.indexed_dataset")


def token_dtype(vocab_size: int) -> type:
    """uint16 whenever the vocabulary fits (as Megatron's preprocessing chooses), else int32."""
    return quiet_megatron_import().DType.optimal_dtype(vocab_size)


def write_indexed(prefix: str, documents: Iterable[list[int]], eod: int, vocab_size: int) -> dict:
    """Write `documents` (token id lists, EOD appended here) to `prefix`.{bin,idx}; return counts."""
    indexed_dataset = quiet_megatron_import()
    dtype = token_dtype(vocab_size)
    builder = indexed_dataset.IndexedDatasetBuilder(indexed_dataset.get_bin_path(prefix), dtype=dtype)
    n_docs = n_tokens = 0
    for ids in documents:
        tokens = numpy.asarray(list(ids) + [eod], dtype=dtype)
        builder.add_document(tokens, [tokens.size])
        n_docs += 1
        n_tokens += int(tokens.size)
    builder.finalize(indexed_dataset.get_idx_path(prefix))
    return {"documents": n_docs, "tokens": n_tokens, "dtype": numpy.dtype(dtype).name}

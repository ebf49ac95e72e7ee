"""Training and validation data: Megatron's GPTDataset, sampled deterministically.

Datasets come from Megatron-Core's BlendedMegatronDatasetBuilder (indexed
datasets written by `megatron-async-prepare-data`, or MockGPTDataset with
`--mock-data`). Sample i of iteration t is global sample t * global_batch + i, and
each data-parallel rank takes its contiguous slice, so a run resumed at iteration
t reads exactly the batches the uninterrupted run would have read.
"""

from __future__ import annotations

import argparse
from typing import Iterator, Optional

import torch
from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset


def build_tokenizer(args: argparse.Namespace):
    if args.tokenizer_type == "SentencePieceTokenizer":
        from megatron_async.data.tokenizer import load_tokenizer

        return load_tokenizer(args.tokenizer_model)
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    return NullTokenizer(args.vocab_size)


def _num_samples(args: argparse.Namespace) -> tuple[int, int]:
    train = args.train_iters * args.global_batch_size
    evaluations = args.train_iters // args.eval_interval + 1
    valid = evaluations * args.eval_iters * args.global_batch_size
    return train, valid


def _cache_path(args: argparse.Namespace) -> Optional[str]:
    """--data-cache-path, keyed by the data's .idx files so replaced data never reuses stale indices."""
    if args.mock_data:
        return args.data_cache_path
    from megatron_async.data.cache import keyed_cache_path

    return keyed_cache_path(args.data_cache_path, list(args.train_data_path) + list(args.valid_data_path or []))


def build_datasets(args: argparse.Namespace, tokenizer) -> tuple[GPTDataset, Optional[GPTDataset]]:
    """(train, valid) datasets; valid is None when there is no validation data."""
    train_samples, valid_samples = _num_samples(args)
    common = dict(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        path_to_cache=_cache_path(args),
        mid_level_dataset_surplus=0.005,
    )
    if args.mock_data:
        config = GPTDatasetConfig(split="99,1,0", **common)
        cls = MockGPTDataset
    else:
        valid = [args.valid_data_path, None] if args.valid_data_path else None
        config = GPTDatasetConfig(
            blend_per_split=[
                [args.train_data_path, None],
                valid,
                None,
            ],
            **common,
        )
        cls = GPTDataset
    train, valid, _ = BlendedMegatronDatasetBuilder(
        cls, [train_samples, valid_samples, 0], lambda: True, config
    ).build()
    return train, valid


def _collate(samples: list[dict]) -> dict:
    return {key: torch.stack([torch.as_tensor(s[key]) for s in samples]) for key in samples[0]}


def microbatch_iterator(
    dataset: GPTDataset,
    iteration: int,
    global_batch_size: int,
    micro_batch_size: int,
    first_sample: int = 0,
) -> Iterator[dict]:
    """This data-parallel rank's microbatches of global batch `iteration`."""
    dp_size = parallel_state.get_data_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    per_rank = global_batch_size // dp_size
    start = first_sample + iteration * global_batch_size + dp_rank * per_rank
    for offset in range(0, per_rank, micro_batch_size):
        indices = range(start + offset, start + offset + micro_batch_size)
        yield _collate([dataset[i % len(dataset)] for i in indices])

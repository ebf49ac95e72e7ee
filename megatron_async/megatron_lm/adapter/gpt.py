"""A GPT entry point for Megatron's own training loop, with no Megatron-LM checkout.

Megatron-LM's `pretrain_gpt.py` imports files that only its repository has, so
the megatron-core wheel cannot run it. This module gives `megatron.training.pretrain`
what that script gives it: the forward step, the loss function and the dataset
provider. The model is built by Megatron itself from its GPT config (layer specs:
Transformer Engine or local, `--spec`, MoE), exactly as for `pretrain_gpt.py`.

Run it through the launcher, which installs the plugin first:

    torchrun --nproc-per-node 2 -m megatron_async.launch --gpt ARGS...
"""

from __future__ import annotations

from functools import partial

import torch
from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

from megatron.training import get_args, pretrain, print_rank_0
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args
from megatron.training.utils import get_blend_and_blend_per_split

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")


def _holds_data() -> bool:
    """First and last pipeline stages read batches (tokens in, labels out); middle ones do not."""
    return parallel_state.is_pipeline_first_stage(ignore_virtual=True) or parallel_state.is_pipeline_last_stage(
        ignore_virtual=True)


def get_batch(data_iterator) -> dict:
    """This stage's microbatch on the device; every tensor None on a middle stage.

    Every tensor-parallel rank of the first and last stage reads the same batch
    from its own iterator (datasets are deterministic), so no broadcast is needed.
    """
    if not _holds_data():
        return dict.fromkeys(BATCH_KEYS)
    batch = next(data_iterator)
    device = torch.cuda.current_device()
    return {key: batch[key].to(device, non_blocking=True) if batch.get(key) is not None else None
            for key in BATCH_KEYS}


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """(sum of masked token losses, token count, report): the schedule divides by the
    token count (or the batch's, with --calculate-per-token-loss); the report is what
    Megatron's train_step sums over microbatches and data-parallel ranks."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = loss_mask.sum().to(torch.int)
    report = torch.cat([loss.detach().view(1), num_tokens.view(1).to(loss.dtype)])
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """One microbatch through this stage's model chunk: per-token losses on the last stage.

    `return_schedule_plan`: Megatron's combined forward-backward step
    (--overlap-moe-expert-parallel-comm) asks for the model's schedule plan of the same inputs
    instead, which it runs node by node beside another microbatch's backward."""
    batch = get_batch(data_iterator)
    run = model.build_schedule_plan if return_schedule_plan else model
    output = run(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"],
                 loss_mask=batch["loss_mask"])
    return output, partial(loss_func, batch["loss_mask"])


def _cache_path(args, blend, blend_per_split):
    """--data-cache-path keyed by the datasets' .idx files (megatron_async.data.cache), so
    data prepared again at the same path never reuses sample indices built for the old."""
    if args.mock_data or args.data_cache_path is None:
        return args.data_cache_path
    from megatron_async.data.cache import keyed_cache_path

    blends = [blend] + list(blend_per_split or [])
    prefixes = sorted({prefix for b in blends if b for prefix in b[0]})
    return keyed_cache_path(args.data_cache_path, prefixes)


def dataset_config(args) -> GPTDatasetConfig:
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        path_to_cache=_cache_path(args, blend, blend_per_split),
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=build_tokenizer(args),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
    )


def datasets_provider(train_val_test_num_samples, vp_stage=None):
    """(train, valid, test) GPT datasets (MockGPTDataset with --mock-data), built on the
    ranks that read data."""
    args = get_args()
    cls = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0("> building GPT datasets ...")
    return BlendedMegatronDatasetBuilder(cls, train_val_test_num_samples, _holds_data, dataset_config(args)).build()


datasets_provider.is_distributed = True  # every rank calls it (Megatron's convention)


def embedding_ranks(pp_ranks: list[int]) -> list[int]:
    """Ranks that hold the word embeddings: the first stage, and the last one when tied."""
    ranks = {pp_ranks[0]}
    if len(pp_ranks) > 1 and not get_args().untie_embeddings_and_output_weights:
        ranks.add(pp_ranks[-1])
    return sorted(ranks)


def main() -> None:
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    config = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
    pretrain(config, datasets_provider, ModelType.encoder_or_decoder, forward_step,
             get_embedding_ranks=embedding_ranks)

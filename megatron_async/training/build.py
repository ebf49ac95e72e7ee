"""Model construction from flags: TransformerConfig, GPT chunks, DDP, schedule hooks."""

from __future__ import annotations

import argparse

import torch
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_async.model import build_gpt_chunks, moe_settings, wrap_ddp


def transformer_config_from_args(args: argparse.Namespace, on_cpu: bool) -> TransformerConfig:
    moe = moe_settings(args.num_experts, args.moe_router_topk, args.moe_token_dispatcher_type,
                       args.moe_aux_loss_coeff)
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        hidden_dropout=args.hidden_dropout,
        init_method_std=args.init_method_std,
        attention_dropout=args.attention_dropout,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        sequence_parallel=False,
        bf16=args.bf16,
        params_dtype=args.params_dtype,
        pipeline_dtype=args.params_dtype,
        use_cpu_initialization=on_cpu,
        bias_dropout_fusion=not on_cpu,
        masked_softmax_fusion=not on_cpu,
        gradient_accumulation_fusion=False,
        **moe,
    )


def build_model(args: argparse.Namespace, vocab_size: int, on_cpu: bool):
    """(DDP-wrapped model chunks, transformer config) for this rank."""
    config = transformer_config_from_args(args, on_cpu)
    chunks = build_gpt_chunks(
        config,
        vocab_size=vocab_size,
        seq_length=args.max_position_embeddings,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
    )
    if not on_cpu:
        for chunk in chunks:
            chunk.cuda(torch.cuda.current_device())
    if args.bf16:
        from megatron.core.transformer.module import Float16Module

        chunks = [Float16Module(config, chunk) for chunk in chunks]
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=args.overlap_grad_reduce,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )
    return wrap_ddp(chunks, config, ddp_config), config

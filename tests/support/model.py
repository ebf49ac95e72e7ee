"""Build Megatron-Core GPT model chunks for this rank and wrap them in Megatron DDP."""

from __future__ import annotations

from typing import Optional

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.transformer_config import TransformerConfig


def transformer_engine_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not usable"
        return False
    import torch

    return torch.cuda.is_available()


def gpt_layer_spec(config: TransformerConfig, use_te: Optional[bool] = None):
    """Transformer Engine spec with TE on CUDA, Megatron's local spec otherwise."""
    if use_te is None:
        use_te = transformer_engine_available()
    num_experts = config.num_moe_experts
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=config.moe_grouped_gemm
        )
    return get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=config.moe_grouped_gemm)


def moe_settings(num_experts: Optional[int], topk: int, dispatcher: str, aux_loss_coeff: float = 0.0) -> dict:
    """TransformerConfig fields for a mixture-of-experts MLP ({} without experts)."""
    if not num_experts:
        return {}
    return dict(
        num_moe_experts=num_experts,
        moe_router_topk=topk,
        moe_token_dispatcher_type=dispatcher,
        moe_aux_loss_coeff=aux_loss_coeff,
        moe_router_load_balancing_type="aux_loss" if aux_loss_coeff > 0 else "none",
        # Megatron's SequentialMLP adds expert biases in place on a view that
        # autograd forbids; MoE models are trained without linear biases anyway.
        add_bias_linear=False,
    )


def build_gpt_chunks(
    config: TransformerConfig,
    vocab_size: int,
    seq_length: int,
    share_embeddings_and_output_weights: bool = False,
    use_te: Optional[bool] = None,
) -> list[GPTModel]:
    """The GPT model chunks this pipeline rank owns (one, or one per virtual stage)."""
    spec = gpt_layer_spec(config, use_te)
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    stages = range(vpp) if vpp else [None]
    chunks = []
    for vp_stage in stages:
        chunks.append(
            GPTModel(
                config=config,
                transformer_layer_spec=spec,
                vocab_size=vocab_size,
                max_sequence_length=seq_length,
                pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                share_embeddings_and_output_weights=share_embeddings_and_output_weights,
                position_embedding_type="learned_absolute",
                vp_stage=vp_stage,
            )
        )
    return chunks


def wrap_ddp(
    chunks: list[GPTModel],
    config: TransformerConfig,
    ddp_config: DistributedDataParallelConfig,
) -> list[DistributedDataParallel]:
    """Megatron DDP around each chunk; only the first chunk's buckets are not delayed."""
    return [
        DistributedDataParallel(
            config=config,
            ddp_config=ddp_config,
            module=chunk,
            disable_bucketing=(index > 0),
        )
        for index, chunk in enumerate(chunks)
    ]


def attach_schedule_hooks(config: TransformerConfig, model: list[DistributedDataParallel], optimizer) -> None:
    """Let Megatron's schedules drive DDP: gradient sync after the last microbatch
    (finalize_model_grads: DP all-reduce / reduce-scatter, tied-embedding and MoE
    reductions), no_sync while accumulating, and the optimizer's loss scale."""
    from megatron.core.distributed import finalize_model_grads

    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    no_sync = [chunk.no_sync for chunk in model]
    config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync

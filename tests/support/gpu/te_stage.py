"""One pipeline stage built from Megatron's Transformer Engine wrappers, on one GPU.

The 2bw hazards live in TE's kernels (a cached fp8 weight refreshed in place,
a fused weight gradient written straight into DDP's `main_grad`), so the check
of them must run real TE modules as Megatron builds them: TENorm (RMSNorm),
TELayerNormColumnParallelLinear, TELinear and TEColumnParallelGroupedLinear,
from a TransformerConfig with bf16 parameters, wrapped in Megatron's DDP (whose
buffers the weight stash mirrors), on a one-rank NCCL group with Megatron's
parallel state. Needs CUDA and Transformer Engine; imported only where both are.
"""

from __future__ import annotations

import os
from contextlib import nullcontext

import torch
import torch.nn.functional as F

TOKENS, HIDDEN, FFN, EXPERTS = 64, 128, 256, 2  # every GEMM dimension a multiple of 16, as fp8 needs
M_SPLITS = [TOKENS // EXPERTS] * EXPERTS  # tokens per expert, each a multiple of 16


def init_single_rank_nccl(seed: int = 1234) -> None:
    """World of one over NCCL on GPU 0, then Megatron's groups and its seeded CUDA RNG tracker."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from tests.support.multiprocess import free_port

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    torch.cuda.set_device(0)
    torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def stage_config(fp8: bool):
    """bf16 parameters, RMSNorm, no biases, fused weight-gradient accumulation; fp8
    (hybrid: e4m3 forward, e5m2 backward) with Megatron's delayed-scaling recipe."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    extra = dict(fp8="hybrid", fp8_recipe="delayed", fp8_amax_history_len=16, fp8_amax_compute_algo="max") \
        if fp8 else {}
    return TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=4,
        bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
        normalization="RMSNorm", add_bias_linear=False, gradient_accumulation_fusion=True,
        hidden_dropout=0.0, attention_dropout=0.0, **extra,
    )


class TEStage(torch.nn.Module):
    """fc2(gelu(fc1(x))) + experts(norm(x)): every TE wrapper 2bw meets in a GPT stage. No
    residual: the input gradient then passes through the weights alone, so a backward that
    reads the wrong weights cannot hide behind the identity path."""

    def __init__(self, config):
        super().__init__()
        from megatron.core.extensions.transformer_engine import (
            TEColumnParallelGroupedLinear,
            TELayerNormColumnParallelLinear,
            TELinear,
            TENorm,
        )

        self.config = config
        self.norm = TENorm(config, HIDDEN, eps=config.layernorm_epsilon)
        self.fc1 = TELayerNormColumnParallelLinear(
            HIDDEN, FFN, config=config, init_method=config.init_method, gather_output=False, bias=False,
            skip_bias_add=False, is_expert=False)
        self.fc2 = TELinear(
            FFN, HIDDEN, parallel_mode="duplicated", config=config, init_method=config.output_layer_init_method,
            bias=False, skip_bias_add=False, skip_weight_param_allocation=False)
        self.experts = TEColumnParallelGroupedLinear(
            EXPERTS, HIDDEN, HIDDEN, config=config, init_method=config.init_method, bias=False,
            skip_bias_add=False, is_expert=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.fc1(x)
        y, _ = self.fc2(F.gelu(y))
        z, _ = self.experts(self.norm(x), M_SPLITS)
        return y + z


def build_stage(fp8: bool):
    """(Megatron DDP around a TEStage, its config); main_grad buffers in fp32."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import MegatronModule

    config = stage_config(fp8)

    class Stage(MegatronModule):  # MegatronModule: DDP and set_is_first_microbatch see a Megatron model
        def __init__(self):
            super().__init__(config=config)
            self.body = TEStage(config)

        def forward(self, x):
            return self.body(x)

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=False)
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=Stage().cuda())
    return ddp, config


def fp8_context(config):
    """Megatron's fp8 autocast for this config (TE's, with the delayed-scaling recipe), or nothing."""
    if not config.fp8:
        return nullcontext()
    from megatron.core.fp8_utils import get_fp8_context

    return get_fp8_context(config)


def fp8_modules(model) -> list:
    """TE modules holding delayed-scaling state (scales and amax histories)."""
    return [m for m in model.modules() if isinstance(getattr(m, "fp8_meta", None), dict)]


_META_KEYS = ("scaling_fwd", "scaling_bwd")
_META_TENSORS = ("scale", "scale_inv", "amax_history")


def snapshot_fp8_meta(model) -> dict:
    """A copy of every module's delayed-scaling tensors: the reference runs a microbatch
    with exactly the scales the interleaved run used for it."""
    out = {}
    for i, module in enumerate(fp8_modules(model)):
        for key in _META_KEYS:
            meta = module.fp8_meta.get(key)
            for name in _META_TENSORS:
                value = getattr(meta, name, None)
                if isinstance(value, torch.Tensor):
                    out[(i, key, name)] = value.detach().clone()
    return out


@torch.no_grad()
def restore_fp8_meta(model, snapshot: dict, keys=_META_KEYS) -> None:
    """Copy a snapshot back in place (TE's global amax buffers keep pointing at these tensors)."""
    for i, module in enumerate(fp8_modules(model)):
        for key in keys:
            meta = module.fp8_meta.get(key)
            for name in _META_TENSORS:
                saved = snapshot.get((i, key, name))
                if saved is not None:
                    getattr(meta, name).copy_(saved)

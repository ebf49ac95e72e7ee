"""Initialise weights so that every parallel layout starts from the same model.

Megatron draws initial weights rank by rank from seeded generators: a PP=2 model
and a PP=1 model with the same `--seed` start from different weights (each stage
continues its own random stream, offset by the pipeline rank). To compare a
`--pipeline-schedule 2bw` run with its `--simulated-delay 1` twin, or TP/EP/DP
layouts with each other, step by step, both must start equal.

Here every parameter is drawn from a generator seeded by (seed, its global name):
the layer index across pipeline stages, the expert index across expert-parallel
ranks, the unsplit shape across tensor-parallel ranks (then cut to this rank's
shard). The distribution follows Megatron's defaults: normal(0, std) for weights,
std / sqrt(2 * num_layers) for the output projections of attention and MLP, zero
biases, layer norms at weight 1 and bias 0.
"""

from __future__ import annotations

import math
import re
import zlib
from typing import Callable

import torch
from megatron.core import parallel_state

_OUTPUT_PROJECTIONS_RE = re.compile(r"(linear_proj|linear_fc2)\.weight\d*$")  # \d*: grouped experts
_GROUPED_EXPERT_PARAM = re.compile(r"(weight|bias)(\d+)")


def innermost_module(chunk):
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def global_param_names(chunk) -> dict[str, str]:
    """Local parameter name -> layout-independent name, for one model chunk."""
    module = innermost_module(chunk)
    layer_of = {}
    decoder = getattr(module, "decoder", None)
    for local, layer in enumerate(getattr(decoder, "layers", [])):
        layer_of[str(local)] = str(layer.layer_number - 1)  # layer_number is global and 1-based
    config = getattr(module, "config", None)
    experts = getattr(config, "num_moe_experts", None) or 0
    ep_size = parallel_state.get_expert_model_parallel_world_size() if experts else 1
    expert_offset = parallel_state.get_expert_model_parallel_rank() * (experts // ep_size) if experts else 0
    names = {}
    for name, _ in module.named_parameters():
        parts = name.split(".")
        if "layers" in parts and parts[parts.index("layers") - 1] == "decoder":  # not mtp.layers
            i = parts.index("layers") + 1
            parts[i] = layer_of.get(parts[i], parts[i])
        if "local_experts" in parts:
            i = parts.index("local_experts") + 1
            parts[i] = str(int(parts[i]) + expert_offset)
        grouped = _GROUPED_EXPERT_PARAM.fullmatch(parts[-1])
        if grouped and "experts" in parts:  # TE's grouped GEMM: weight<i> of local expert i
            parts[-1] = f"{grouped.group(1)}{int(grouped.group(2)) + expert_offset}"
        names[name] = ".".join(parts)
    if getattr(module, "share_embeddings_and_output_weights", False) and "output_layer.weight" in names:
        names["output_layer.weight"] = "embedding.word_embeddings.weight"  # the last stage's copy of the tied weight
    return names


def megatron_like(std: float, num_layers: int) -> Callable[[str, list, torch.Generator], torch.Tensor]:
    """Megatron's default initial values, drawn from `gen` for the global name."""
    output_std = std / math.sqrt(2.0 * num_layers)

    def draw(name: str, shape: list, gen: torch.Generator) -> torch.Tensor:
        if "norm" in name.split(".")[-2] or name.endswith("layer_norm_weight"):
            return torch.ones(shape) if name.endswith("weight") else torch.zeros(shape)
        if re.search(r"bias\d*$", name):
            return torch.zeros(shape)
        scale = output_std if _OUTPUT_PROJECTIONS_RE.search(name) else std
        return torch.randn(shape, generator=gen) * scale

    return draw


@torch.no_grad()
def init_by_global_name(model, seed: int, draw: Callable[[str, list, torch.Generator], torch.Tensor]) -> None:
    """Overwrite every parameter of `model` (a list of chunks) with `draw` for its
    global name and unsplit shape, then keep this tensor-parallel rank's shard.
    Call before the optimizer is built (it copies the weights)."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    for chunk in model:
        names = global_param_names(chunk)
        for name, param in innermost_module(chunk).named_parameters():
            gname = names[name]
            sharded = tp > 1 and getattr(param, "tensor_model_parallel", False)
            shape = list(param.shape)
            if sharded:
                shape[param.partition_dim] *= tp
            gen = torch.Generator().manual_seed(seed + zlib.crc32(gname.encode()))
            full = draw(gname, shape, gen)
            if sharded:
                full = full.chunk(tp, dim=param.partition_dim)[tp_rank]
            param.data.copy_(full)

"""A one-stage Megatron GPT's state dict under transformers' names and layouts.

Megatron's fused `linear_qkv` holds, per query group, that group's query heads, then its
key head, then its value head ([q.., k, v] x groups); transformers keeps all queries, then
all keys, then all values, and repeats key/value group g for query heads g*r .. g*r + r-1,
the same grouping. `linear_fc1` of a SwiGLU MLP is [gate; up], and GPT-2's Conv1D stores
weights transposed ([in, out]). Qwen3-MoE keeps every expert of a layer in one tensor,
indexed by the expert's global number, as its router's rows are: expert e's [gate; up]
`linear_fc1` is `gate_up_proj[e]` and its `linear_fc2` is `down_proj[e]`. Multi-token
prediction layers (`mtp.*`) have no place in any class and are left out (mtp_dropped).
"""

from __future__ import annotations

import torch


def split_qkv(fused: torch.Tensor, heads: int, groups: int, head_dim: int):
    """(q, k, v) of a fused linear_qkv weight [(heads + 2 groups) head_dim, in] or bias."""
    per_group = heads // groups
    grouped = fused.reshape(groups, per_group + 2, head_dim, *fused.shape[1:])
    rest = fused.shape[1:]
    q = grouped[:, :per_group].reshape(heads * head_dim, *rest)
    k = grouped[:, per_group].reshape(groups * head_dim, *rest)
    v = grouped[:, per_group + 1].reshape(groups * head_dim, *rest)
    return q, k, v


def mtp_dropped(sd: dict) -> int:
    """How many multi-token-prediction layers the export leaves out."""
    return len({key.split(".")[2] for key in sd if key.startswith("mtp.layers.")})


def _layers(sd: dict) -> int:
    return len({key.split(".")[2] for key in sd if key.startswith("decoder.layers.")})


def _gpt2(sd: dict, config) -> dict:
    heads = config.num_attention_heads
    out = {"transformer.wte.weight": sd["embedding.word_embeddings.weight"],
           "transformer.wpe.weight": sd["embedding.position_embeddings.weight"]}
    for i in range(_layers(sd)):
        src, dst = f"decoder.layers.{i}.", f"transformer.h.{i}."
        for name in ("weight", "bias"):
            out[dst + f"ln_1.{name}"] = sd[src + f"input_layernorm.{name}"]
            out[dst + f"ln_2.{name}"] = sd[src + f"pre_mlp_layernorm.{name}"]
        qkv = sd[src + "self_attention.linear_qkv.weight"]
        out[dst + "attn.c_attn.weight"] = torch.cat(split_qkv(qkv, heads, heads, qkv.shape[1] // heads)).t()
        if src + "self_attention.linear_qkv.bias" in sd:
            out[dst + "attn.c_attn.bias"] = torch.cat(split_qkv(sd[src + "self_attention.linear_qkv.bias"], heads,
                                                                heads, qkv.shape[1] // heads))
        for megatron, hf in (("self_attention.linear_proj", "attn.c_proj"), ("mlp.linear_fc1", "mlp.c_fc"),
                             ("mlp.linear_fc2", "mlp.c_proj")):
            out[dst + hf + ".weight"] = sd[src + megatron + ".weight"].t()
            if src + megatron + ".bias" in sd:
                out[dst + hf + ".bias"] = sd[src + megatron + ".bias"]
    out["transformer.ln_f.weight"] = sd["decoder.final_layernorm.weight"]
    out["transformer.ln_f.bias"] = sd["decoder.final_layernorm.bias"]
    return out


def _experts(sd: dict, src: str, dst: str, experts: int) -> dict:
    """One MoE layer's router and experts, stacked in the router's (global) expert order."""
    fc1 = [sd[src + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] for e in range(experts)]
    fc2 = [sd[src + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] for e in range(experts)]
    return {dst + "mlp.gate.weight": sd[src + "mlp.router.weight"],
            dst + "mlp.experts.gate_up_proj": torch.stack(fc1), dst + "mlp.experts.down_proj": torch.stack(fc2)}


def _qwen3_moe(sd: dict, config) -> dict:
    out = _llama({k: v for k, v in sd.items() if ".mlp." not in k}, config)
    for i in range(_layers(sd)):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[dst + "self_attn.q_norm.weight"] = sd[src + "self_attention.q_layernorm.weight"]
        out[dst + "self_attn.k_norm.weight"] = sd[src + "self_attention.k_layernorm.weight"]
        out.update(_experts(sd, src, dst, config.num_moe_experts))
    return out


def _llama(sd: dict, config) -> dict:
    out = {"model.embed_tokens.weight": sd["embedding.word_embeddings.weight"]}
    for i in range(_layers(sd)):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[dst + "input_layernorm.weight"] = sd[src + "input_layernorm.weight"]
        out[dst + "post_attention_layernorm.weight"] = sd[src + "pre_mlp_layernorm.weight"]
        for name in ("weight", "bias"):
            key = src + f"self_attention.linear_qkv.{name}"
            if key in sd:
                q, k, v = split_qkv(sd[key], config.num_attention_heads, config.num_query_groups, config.kv_channels)
                out.update({dst + f"self_attn.q_proj.{name}": q, dst + f"self_attn.k_proj.{name}": k,
                            dst + f"self_attn.v_proj.{name}": v})
            if src + f"self_attention.linear_proj.{name}" in sd:
                out[dst + f"self_attn.o_proj.{name}"] = sd[src + f"self_attention.linear_proj.{name}"]
            if src + f"mlp.linear_fc1.{name}" in sd:
                gate, up = torch.chunk(sd[src + f"mlp.linear_fc1.{name}"], 2, dim=0)
                out[dst + f"mlp.gate_proj.{name}"], out[dst + f"mlp.up_proj.{name}"] = gate, up
            if src + f"mlp.linear_fc2.{name}" in sd:
                out[dst + f"mlp.down_proj.{name}"] = sd[src + f"mlp.linear_fc2.{name}"]
    out["model.norm.weight"] = sd["decoder.final_layernorm.weight"]
    return out


def hf_state_dict(arch: str, sd: dict, config, expected: dict) -> dict:
    """transformers' state dict for `sd` (Megatron's names, one stage); `expected` maps the
    transformers model's own keys to shapes. A bias it has and Megatron has not is zeros;
    any other difference is an error of this mapping, never written."""
    sd = {key: value for key, value in sd.items() if not key.startswith("mtp.")}
    out = {"gpt2": _gpt2, "llama": _llama, "qwen3_moe": _qwen3_moe}[arch](sd, config)
    if "output_layer.weight" in sd:
        out["lm_head.weight"] = sd["output_layer.weight"]
    elif "lm_head.weight" in expected:  # tied: Megatron's output layer is the word embeddings
        out["lm_head.weight"] = sd["embedding.word_embeddings.weight"]
    for key, shape in expected.items():
        if key not in out and key.endswith(".bias"):
            dtype = next(iter(out.values())).dtype
            out[key] = torch.zeros(shape, dtype=dtype)
    missing = sorted(set(expected) - set(out))
    unexpected = sorted(set(out) - set(expected))
    wrong = sorted(k for k in set(out) & set(expected) if tuple(out[k].shape) != tuple(expected[k]))
    if missing or unexpected or wrong:
        raise RuntimeError(f"megatron-async: the {arch} mapping does not fit: missing {missing[:4]}, "
                           f"unexpected {unexpected[:4]}, shapes {wrong[:4]}")
    return {key: value.contiguous() for key, value in out.items()}

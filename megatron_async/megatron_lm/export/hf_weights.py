"""A one-stage Megatron GPT's weights under the names and layouts transformers saves them with.

Any part of the model maps on its own (the embedding, a layer, the output), so the export
maps and writes one group at a time. Megatron's fused `linear_qkv` holds, per query group,
that group's query heads, then its key head, then its value head ([q.., k, v] x groups);
transformers keeps all queries, then all keys, then all values, and repeats key/value group g
for query heads g*r .. g*r + r-1, the same grouping. `linear_fc1` of a SwiGLU MLP is
[gate; up], and GPT-2's Conv1D stores weights transposed ([in, out]). Qwen3-MoE's files hold
each expert on its own, numbered as the router's rows are (what transformers' save_pretrained
writes and every Qwen3-MoE reader loads): expert e's [gate; up] `linear_fc1` is
`mlp.experts.{e}.gate_proj` and `up_proj`, its `linear_fc2` is `down_proj`. A tied output
layer is not written (transformers ties it to the embedding on load). Multi-token prediction
layers (`mtp.*`) have no place in any class and are left out (mtp_dropped).
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


def mtp_dropped(keys) -> int:
    """How many multi-token-prediction layers the export leaves out (of Megatron's weight names)."""
    return len({key.split(".")[2] for key in keys if key.startswith("mtp.layers.")})


def _layer_indices(sd: dict) -> list[int]:
    return sorted({int(key.split(".")[2]) for key in sd if key.startswith("decoder.layers.")})


def _renamed(sd: dict, names: dict) -> dict:
    """The weights of `names` (Megatron's: transformers') that `sd` holds, renamed."""
    return {hf: sd[megatron] for megatron, hf in names.items() if megatron in sd}


def _gpt2(sd: dict, config) -> dict:
    heads = config.num_attention_heads
    out = _renamed(sd, {"embedding.word_embeddings.weight": "transformer.wte.weight",
                        "embedding.position_embeddings.weight": "transformer.wpe.weight"})
    for i in _layer_indices(sd):
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
    out.update(_renamed(sd, {"decoder.final_layernorm.weight": "transformer.ln_f.weight",
                             "decoder.final_layernorm.bias": "transformer.ln_f.bias"}))
    return out


def _experts(sd: dict, src: str, dst: str, experts: int) -> dict:
    """One MoE layer's router and its experts, each under its global number (the router's row)."""
    out = {dst + "mlp.gate.weight": sd[src + "mlp.router.weight"]}
    for e in range(experts):
        expert = f"{src}mlp.experts.local_experts.{e}."
        gate, up = torch.chunk(sd[expert + "linear_fc1.weight"], 2, dim=0)
        out[f"{dst}mlp.experts.{e}.gate_proj.weight"], out[f"{dst}mlp.experts.{e}.up_proj.weight"] = gate, up
        out[f"{dst}mlp.experts.{e}.down_proj.weight"] = sd[expert + "linear_fc2.weight"]
    return out


def _qwen3_moe(sd: dict, config) -> dict:
    out = _llama({k: v for k, v in sd.items() if ".mlp." not in k}, config)
    for i in _layer_indices(sd):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[dst + "self_attn.q_norm.weight"] = sd[src + "self_attention.q_layernorm.weight"]
        out[dst + "self_attn.k_norm.weight"] = sd[src + "self_attention.k_layernorm.weight"]
        out.update(_experts(sd, src, dst, config.num_moe_experts))
    return out


def _llama(sd: dict, config) -> dict:
    out = _renamed(sd, {"embedding.word_embeddings.weight": "model.embed_tokens.weight"})
    for i in _layer_indices(sd):
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
    out.update(_renamed(sd, {"decoder.final_layernorm.weight": "model.norm.weight"}))
    return out


def hf_tensors(arch: str, sd: dict, config) -> dict:
    """transformers' saved tensors for the part of the model `sd` holds (Megatron's one-stage
    names, whole groups: the embedding, layers, the final norm and output layer)."""
    sd = {key: value for key, value in sd.items() if not key.startswith("mtp.")}
    out = {"gpt2": _gpt2, "llama": _llama, "qwen3_moe": _qwen3_moe}[arch](sd, config)
    out.update(_renamed(sd, {"output_layer.weight": "lm_head.weight"}))
    return out


def saved_layout(hf_config) -> dict:
    """The tensors transformers' `save_pretrained` writes for this config, name: shape (the
    model's own state without its tied copies, in the checkpoint format its classes load)."""
    import transformers
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    model.tie_weights()
    state = remove_tied_weights_from_state_dict(model.state_dict(), model)
    return {key: tuple(value.shape) for key, value in revert_weight_conversion(model, state).items()}


def zero_biases(arch: str, planned: dict, layout: dict) -> dict:
    """The biases `layout` has and the mapped weights (`planned`, name: (shape, dtype)) have not,
    as zeros (the function Megatron computes without them); any other difference is an error of
    this mapping, and nothing is written."""
    dtype = next(iter(planned.values()))[1]
    zeros = {key: (shape, dtype) for key, shape in layout.items() if key not in planned and key.endswith(".bias")}
    missing = sorted(set(layout) - set(planned) - set(zeros))
    unexpected = sorted(set(planned) - set(layout))
    wrong = sorted(k for k in set(planned) & set(layout) if tuple(planned[k][0]) != tuple(layout[k]))
    if missing or unexpected or wrong:
        raise RuntimeError(f"megatron-async: the {arch} mapping does not fit: missing {missing[:4]}, "
                           f"unexpected {unexpected[:4]}, shapes {wrong[:4]}")
    return zeros

"""Which Megatron MoE GPTs Qwen3MoeForCausalLM computes, and its config for one.

Qwen3-MoE's layer is the 10B example's: RMSNorm, rotate-half RoPE over the whole head, a
per-head RMSNorm of queries and keys before RoPE (Megatron's `--qk-layernorm`), no attention
or expert biases, no shared expert, SwiGLU experts. Its router takes the softmax over every
expert's logit and keeps the top k; with `norm_topk_prob` it divides them by their sum,
which equals Megatron's default router (top k of the logits, softmax over those k), and
without it is Megatron's `--moe-router-pre-softmax` (softmax over all, top k, as they are).
The load-balancing losses (aux, z-loss) only add gradients, never change the forward, and
Megatron's evaluation drops no token without a capacity factor. Any router or layer setting
that changes which experts a token reaches or their weights beyond that has no counterpart
in the class and is refused naming its flag.
"""

from __future__ import annotations

from megatron_async.megatron_lm.export import ExportError

# (argument, the value Qwen3-MoE needs): each other value changes the routing or the layer
NEUTRAL = (
    ("moe_router_score_function", "softmax"), ("moe_router_topk_scaling_factor", None),
    ("moe_router_num_groups", None), ("moe_router_group_topk", None), ("moe_router_enable_expert_bias", False),
    ("moe_expert_capacity_factor", None), ("moe_pad_expert_input_to_capacity", False),
    ("moe_expert_rank_capacity_factor", None), ("moe_shared_expert_intermediate_size", None),
    ("moe_latent_size", None), ("moe_mlp_glu_interleave_size", None), ("moe_apply_probs_on_input", False),
    ("moe_router_force_load_balancing", False), ("moe_router_force_biased", None),
    ("moe_enable_routing_replay", False), ("add_bias_linear", False),
)
WHY = {
    "moe_router_score_function": "Qwen3-MoE's router scores experts by softmax only",
    "moe_router_topk_scaling_factor": "Qwen3-MoE does not scale the top-k weights",
    "moe_router_num_groups": "Qwen3-MoE has no group-limited routing",
    "moe_router_group_topk": "Qwen3-MoE has no group-limited routing",
    "moe_router_enable_expert_bias": "Qwen3-MoE's router has no expert bias to shift the top-k choice",
    "moe_expert_capacity_factor": "Qwen3-MoE drops no token; a capacity factor does",
    "moe_pad_expert_input_to_capacity": "Qwen3-MoE drops no token; padding to capacity needs a capacity factor",
    "moe_expert_rank_capacity_factor": "Qwen3-MoE drops no token; a capacity factor does",
    "moe_shared_expert_intermediate_size": "Qwen3-MoE has no shared expert",
    "add_bias_linear": "Qwen3-MoE's experts and attention output have no bias; train with --disable-bias-linear",
}


def _refuse(dest: str, value, why: str):
    from megatron_async.megatron_lm.export.megatron_flags import flag

    shown = "" if isinstance(value, bool) else f" {value}"
    raise ExportError(f"{flag(dest)}{shown}: {why}; the checkpoint is not exported")


def check(args, config) -> None:
    """Refuse, naming the flag, an MoE GPT that Qwen3MoeForCausalLM does not compute."""
    import torch.nn.functional as F

    for dest, neutral in NEUTRAL:
        value = getattr(args, dest, neutral)
        if value != neutral:
            _refuse(dest, value, WHY.get(dest, "Qwen3-MoE has no counterpart"))
    freq = args.moe_layer_freq
    if not (freq == 1 or (isinstance(freq, list) and all(f == 1 for f in freq))):
        _refuse("moe_layer_freq", freq, "only a model whose every layer is MoE is exported (dense layers between "
                "them are not mapped)")
    if args.position_embedding_type != "rope":
        _refuse("position_embedding_type", args.position_embedding_type, "Qwen3-MoE's positions are rope")
    if args.normalization != "RMSNorm":
        _refuse("normalization", args.normalization, "Qwen3-MoE's norms are RMSNorm")
    if not (config.gated_linear_unit and config.activation_func is F.silu):
        _refuse("swiglu", False, "Qwen3-MoE's experts are SwiGLU")
    if not args.qk_layernorm:
        _refuse("qk_layernorm", False, "Qwen3-MoE normalises each query and key head (RMSNorm); train with it")


def hf_config(args, config, common: dict):
    import transformers

    return transformers.Qwen3MoeConfig(
        num_key_value_heads=config.num_query_groups, head_dim=config.kv_channels, hidden_act="silu",
        rms_norm_eps=config.layernorm_epsilon,
        rope_parameters={"rope_type": "default", "rope_theta": float(args.rotary_base)},
        attention_bias=config.add_qkv_bias, num_experts=config.num_moe_experts,
        num_experts_per_tok=config.moe_router_topk, moe_intermediate_size=config.moe_ffn_hidden_size,
        intermediate_size=config.ffn_hidden_size, norm_topk_prob=not config.moe_router_pre_softmax,
        decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=args.moe_aux_loss_coeff,
        use_sliding_window=False, **common)

"""Which transformers class computes the same function as a Megatron GPT, from its saved arguments.

Two fit exactly, as Megatron-Core's local and Transformer Engine layers compute them:
- GPT2LMHeadModel: LayerNorm, GELU MLP, learned absolute positions, one key/value head per
  query head, head size hidden / heads. GELU is the tanh form (`gelu_new`) where Megatron
  fuses it with the bias (`bias_gelu_impl` is the tanh approximation), the exact one otherwise.
- LlamaForCausalLM: RMSNorm, SwiGLU, rotary positions (rotate-half, whole head), any number
  of query groups.
- Qwen3MoeForCausalLM: an MoE GPT of that layer with QK-norm and a softmax top-k router
  (hf_moe.py says which router settings fit).
A bias Megatron does not have is exported as zeros (the same function). Multi-token
prediction layers are left out: they train the model, and inference does not run them.
Everything else that changes the forward (MLA, QK norms without experts, post-LN, windows,
muP, other activations or positions, a custom layer spec) has no counterpart here and is
refused naming its flag, before anything is read or written.
"""

from __future__ import annotations

from megatron_async.megatron_lm.export import ExportError
from megatron_async.megatron_lm.export.megatron_flags import flag

# (argument, the value every supported architecture needs): each other value changes the
# forward in a way neither class computes
NEUTRAL = (
    ("multi_latent_attention", False),
    ("experimental_attention_variant", None), ("hybrid_layer_pattern", None),
    ("heterogeneous_layers_config_path", None), ("spec", None), ("softmax_type", "vanilla"),
    ("apply_residual_connection_post_layernorm", False), ("layernorm_zero_centered_gamma", False),
    ("qk_l2_norm", False), ("attention_output_gate", False),
    ("rotary_interleaved", False), ("window_size", None), ("no_rope_freq", None), ("use_mup", False),
    ("rotary_percent", 1.0), ("rotary_seq_len_interpolation_factor", None), ("use_rope_scaling", False),
    ("mrope_section", None), ("rope_type", None), ("squared_relu", False), ("openai_gelu", False),
    ("quick_geglu", False), ("activation_func_clamp_value", None), ("glu_linear_offset", 0.0),
    ("add_position_embedding", True),
)


def _refuse(dest: str, value, why: str):
    shown = "" if isinstance(value, bool) else f" {value}"
    raise ExportError(f"{flag(dest)}{shown}: {why}")


def refuse_unmapped(args) -> None:
    """Refuse, naming the flag, any saved argument that changes the forward beyond both classes."""
    for dest, neutral in NEUTRAL:
        value = getattr(args, dest, neutral)
        if value != neutral:
            _refuse(dest, value, "no transformers class mapped here computes this; the checkpoint is not exported")


def architecture(args, config) -> str:
    """'gpt2', 'llama' or 'qwen3_moe' for a run's saved arguments and its TransformerConfig; refuses otherwise."""
    refuse_unmapped(args)
    import torch.nn.functional as F

    from megatron_async.megatron_lm.export import hf_moe

    if args.num_experts:
        hf_moe.check(args, config)
        return "qwen3_moe"
    if args.qk_layernorm:
        _refuse("qk_layernorm", True, "per-head query/key norms are exported only with MoE (as Qwen3-MoE)")

    rope = args.position_embedding_type == "rope"
    if args.position_embedding_type not in ("rope", "learned_absolute"):
        _refuse("position_embedding_type", args.position_embedding_type,
                "only learned_absolute (GPT-2) and rope (Llama) positions are exported")
    if args.normalization == "RMSNorm":
        if not rope:
            _refuse("position_embedding_type", args.position_embedding_type,
                    "with --normalization RMSNorm only rope positions (Llama) are exported")
        if not (config.gated_linear_unit and config.activation_func is F.silu):
            _refuse("swiglu", False, "with --normalization RMSNorm only a SwiGLU MLP (Llama) is exported")
        return "llama"
    if args.normalization != "LayerNorm":
        _refuse("normalization", args.normalization, "only LayerNorm (GPT-2) and RMSNorm (Llama) are exported")
    if rope:
        _refuse("position_embedding_type", "rope", "with LayerNorm only learned_absolute positions (GPT-2) are "
                "exported; rope needs --normalization RMSNorm --swiglu (Llama)")
    if config.gated_linear_unit:
        _refuse("swiglu", True, "with LayerNorm only a GELU MLP (GPT-2) is exported; --swiglu needs "
                "--normalization RMSNorm --position-embedding-type rope (Llama)")
    if config.activation_func is not F.gelu:
        raise ExportError(f"the MLP's activation {getattr(config.activation_func, '__name__', '?')} has no "
                          "counterpart in the GPT-2 mapped here (torch's GELU, or its tanh form fused with the bias)")
    if config.use_te_activation_func:
        _refuse("use_te_activation_func", True, "Transformer Engine's GELU is not mapped")
    if config.num_query_groups != config.num_attention_heads:
        _refuse("num_query_groups", config.num_query_groups, "GPT-2 has one key/value head per query head "
                "(grouped-query attention is exported with --normalization RMSNorm --swiglu, as Llama)")
    if config.kv_channels * config.num_attention_heads != config.hidden_size:
        _refuse("kv_channels", config.kv_channels, "GPT-2's head size is --hidden-size / --num-attention-heads")
    return "gpt2"


CLASSES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def gelu_name(config) -> str:
    """transformers' name for the GELU Megatron's MLP applies: the tanh form when fused with the bias."""
    return "gelu_new" if config.bias_activation_fusion and config.add_bias_linear else "gelu"


def hf_config(arch: str, args, config, vocab_size: int, dtype, special_ids: dict):
    """The transformers config of the exported model (vocabulary as padded in training: the
    padding rows are part of Megatron's softmax)."""
    import transformers

    tied = not args.untie_embeddings_and_output_weights
    common = dict(vocab_size=vocab_size, num_hidden_layers=config.num_layers, hidden_size=config.hidden_size,
                  num_attention_heads=config.num_attention_heads, max_position_embeddings=args.max_position_embeddings,
                  tie_word_embeddings=tied, dtype=dtype, architectures=[CLASSES[arch]], **special_ids)
    if arch == "qwen3_moe":
        from megatron_async.megatron_lm.export import hf_moe

        return hf_moe.hf_config(args, config, common)
    if arch == "gpt2":
        c = transformers.GPT2Config(n_inner=config.ffn_hidden_size, activation_function=gelu_name(config),
                                    layer_norm_epsilon=config.layernorm_epsilon, resid_pdrop=0.0, embd_pdrop=0.0,
                                    attn_pdrop=0.0, **common)
    else:
        c = transformers.LlamaConfig(
            intermediate_size=config.ffn_hidden_size, num_key_value_heads=config.num_query_groups,
            head_dim=config.kv_channels, hidden_act="silu", rms_norm_eps=config.layernorm_epsilon,
            rope_parameters={"rope_type": "default", "rope_theta": float(args.rotary_base)},
            attention_bias=config.add_bias_linear or config.add_qkv_bias, mlp_bias=config.add_bias_linear, **common)
    return c

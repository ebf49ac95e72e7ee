"""Megatron optimizer and learning-rate scheduler from command-line flags."""

from __future__ import annotations

import argparse
import functools

from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


def _emerging_names() -> list[str]:
    try:
        from megatron.core.optimizer.emerging_optimizers import _EMERGING_OPTIMIZERS
    except ImportError:
        return []
    return list(_EMERGING_OPTIMIZERS)


@functools.lru_cache(maxsize=None)
def _builds_and_steps(name: str) -> bool:
    """Whether Megatron builds `name` the way get_megatron_optimizer does and it can step.

    Megatron-Core 0.19.2 registers every optimizer of emerging-optimizers 0.3.0, but
    passes `betas` to those without an adapter of their own (mop, polargrad, scion, spel,
    muon_hyperball, sinkhorn_muon refuse it) and its adaptive_muon lacks attributes
    0.3.0's step reads. A one-step probe on a 2x2 weight finds out.
    """
    from types import SimpleNamespace

    import torch
    from megatron.core.optimizer.emerging_optimizers import _create_emerging_optimizer

    weight = torch.nn.Parameter(torch.ones(2, 2))
    weight.grad = torch.eye(2)
    chunk = SimpleNamespace(config=SimpleNamespace(num_attention_heads=1, num_query_groups=1, kv_channels=2))
    try:
        opt, _ = _create_emerging_optimizer(OptimizerConfig(optimizer=name, lr=1e-3), [{"params": [weight]}], name,
                                            [chunk], None)
        opt.step()
    except Exception:  # noqa: BLE001 - any failure means "not usable with this Megatron"
        return False
    return True


def is_available(name: str) -> bool:
    return name in ("adam", "sgd") or (name in _emerging_names() and _builds_and_steps(name))


def available_optimizers() -> list[str]:
    """Megatron's own (adam, sgd) plus the emerging optimizers it registers and can build here
    (muon, lion, soap, ...)."""
    return sorted(n for n in ("adam", "sgd", *_emerging_names()) if is_available(n))


def is_emerging(name: str) -> bool:
    """Built by Megatron's emerging-optimizer path (its own param split, layer-wise distribution)."""
    return name not in ("adam", "sgd")


def muon_coefficient_types() -> list[str]:
    """Newton-Schulz coefficient sets the installed emerging-optimizers offers (empty if absent)."""
    try:
        from megatron.core.optimizer.emerging_optimizers import get_supported_coefficient_types

        return [t for t in get_supported_coefficient_types() if t != "custom"]  # custom needs sets we cannot pass
    except (ImportError, AssertionError):
        return []


# OptimizerConfig fields that are set from the flag of the same name when present.
_PASSTHROUGH = (
    "muon_momentum", "muon_split_qkv", "muon_nesterov", "muon_scale_mode", "muon_fp32_matmul_prec",
    "muon_coefficient_type", "muon_num_ns_steps", "muon_tp_mode", "muon_extra_scale_factor",
    "muon_scalar_optimizer", "lion_beta1", "lion_beta2", "use_layer_wise_distributed_optimizer",
)


def optimizer_config(args: argparse.Namespace) -> OptimizerConfig:
    extra = {name: getattr(args, name) for name in _PASSTHROUGH if hasattr(args, name)}
    # Megatron's LayerWiseDistributedOptimizer wraps its per-rank torch optimizers in
    # the mixed-precision wrapper only when bf16 is set, and leaves bare torch
    # optimizers (which its chain cannot drive) otherwise. That wrapper keeps fp32
    # parameters in fp32 (no master copy), so an fp32 model asks for it too.
    mixed_precision_wrapper = args.bf16 or getattr(args, "use_layer_wise_distributed_optimizer", False)
    return OptimizerConfig(
        optimizer=args.optimizer,
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum,
        clip_grad=args.clip_grad,
        bf16=mixed_precision_wrapper,
        params_dtype=args.params_dtype,
        use_distributed_optimizer=args.use_distributed_optimizer,
        **extra,
    )


def route_position_embeddings_to_adam(model) -> None:
    """Megatron marks only the word embeddings and the output layer as embeddings; a
    learned position table is 2-D as well and would otherwise be orthogonalised by Muon."""
    for chunk in model:
        for name, param in chunk.named_parameters():
            if name.endswith("position_embeddings.weight"):
                param.is_embedding_or_output_parameter = True


def build_optimizer(args: argparse.Namespace, model):
    """(MegatronOptimizer, OptimizerParamScheduler) for the DDP-wrapped model chunks.

    With `--delay-correction ef` the optimizer is wrapped in ErrorFeedbackOptimizer,
    which keeps the MegatronOptimizer interface (and saves its state with it).
    """
    if is_emerging(args.optimizer):
        route_position_embeddings_to_adam(model)
    optimizer = get_megatron_optimizer(optimizer_config(args), model)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if args.lr_warmup_iters > 0 else args.lr,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters,
        lr_decay_steps=args.lr_decay_iters,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters,
        wd_incr_style="constant",
        wsd_decay_steps=None,
        lr_wsd_decay_style=None,
    )
    if getattr(args, "delay_correction", "none") == "ef":
        from megatron_async.delay_correction import ErrorFeedbackOptimizer

        optimizer = ErrorFeedbackOptimizer(optimizer, ef_lambda=args.ef_lambda)
    return optimizer, scheduler

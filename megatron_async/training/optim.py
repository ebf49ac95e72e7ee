"""Megatron optimizer and learning-rate scheduler from command-line flags."""

from __future__ import annotations

import argparse

from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


def available_optimizers() -> list[str]:
    """Megatron's own (adam, sgd) plus the emerging optimizers it has registered (muon, lion, soap, ...)."""
    names = {"adam", "sgd"}
    try:
        from megatron.core.optimizer.emerging_optimizers import _EMERGING_OPTIMIZERS

        names.update(_EMERGING_OPTIMIZERS)
    except ImportError:
        pass
    return sorted(names)


def optimizer_config(args: argparse.Namespace) -> OptimizerConfig:
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
        bf16=args.bf16,
        params_dtype=args.params_dtype,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )


def build_optimizer(args: argparse.Namespace, model):
    """(MegatronOptimizer, OptimizerParamScheduler) for the DDP-wrapped model chunks."""
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
    return optimizer, scheduler

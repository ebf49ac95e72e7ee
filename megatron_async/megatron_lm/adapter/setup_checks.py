"""Megatron's checks that run only while it sets training up, run during flag validation.

Megatron checks much of a command line only where it builds from it: the model's
TransformerConfig (or MLATransformerConfig; ModelParallelConfig's checks come with
them) when it builds the model, the optimizer, DDP and checkpoint configurations
and the learning-rate scheduler once its process groups exist. Each raises in
`__post_init__` or `__init__`, a traceback on every rank after the model is built.
`check_setup` builds them once from the validated arguments, inside
megatron_asserts.as_flag_errors, so a failed check is one line naming the flag
before any process group exists; and it refuses `--transformer-impl
transformer_engine` where Transformer Engine does not import (the model's layer
specs would call its missing classes).

The checks read this machine (Transformer Engine, its version): a command line
checked for another machine (megatron_async.check_flags without --cpu-flags) skips
them, inside `for_another_machine()`.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
from types import SimpleNamespace
from unittest import mock

from megatron_async.megatron_lm.adapter.megatron_asserts import as_flag_errors
from megatron_async.megatron_lm.safety.failures import FlagError

_OTHER_MACHINE = []  # non-empty inside for_another_machine()


@contextlib.contextmanager
def for_another_machine():
    """Validation of a command line that will run elsewhere: the machine's checks are skipped."""
    _OTHER_MACHINE.append(True)
    try:
        yield
    finally:
        _OTHER_MACHINE.pop()


def check_setup(args: argparse.Namespace) -> None:
    """Build what Megatron builds from `args` before its first iteration, for its checks only:
    a failed one raises a FlagError naming the flag. `args` is left as it was."""
    if _OTHER_MACHINE or getattr(args, "yaml_cfg", None) is not None:
        return
    _check_transformer_engine(args)
    from megatron.training.argument_utils import core_transformer_config_from_args, pretrain_cfg_container_from_args

    with as_flag_errors(args, "Megatron's model configuration (TransformerConfig)"):
        model = core_transformer_config_from_args(args)
    with as_flag_errors(args, "Megatron's training configuration (optimizer, DDP, checkpoints)"):
        pretrain_cfg_container_from_args(args, model)
    if builds_an_optimizer(args):
        with as_flag_errors(args, "Megatron's learning-rate scheduler"):
            _build_scheduler(args)


def builds_an_optimizer(args: argparse.Namespace) -> bool:
    """Whether Megatron builds an optimizer and its scheduler (setup_model_and_optimizer)."""
    return not args.skip_train or (getattr(args, "perform_rl_step", False) and not args.no_load_optim)


def _build_scheduler(args: argparse.Namespace) -> None:
    """Megatron's own get_optimizer_param_scheduler on a copy of `args` (it fills in
    --lr-decay-iters and, sample-based, --train-iters) and an optimizer with no parameter
    groups; its printing is dropped. A step batch-size schedule counts iterations with
    Megatron's microbatch calculator, which exists only after validation: skipped there."""
    if args.train_samples and getattr(args, "step_batch_size_schedule", None) is not None:
        return
    from megatron.training import training

    scratch = copy.copy(args)
    with mock.patch.object(training, "get_args", lambda: scratch), contextlib.redirect_stdout(io.StringIO()):
        training.get_optimizer_param_scheduler(SimpleNamespace(param_groups=[]))


def _check_transformer_engine(args: argparse.Namespace) -> None:
    """Megatron's Transformer Engine layer specs where TE does not import: the model
    build fails calling a missing class. A --spec of the user's own may not need TE."""
    if args.transformer_impl != "transformer_engine" or getattr(args, "spec", None):
        return
    from megatron.core.extensions import transformer_engine

    if not transformer_engine.HAVE_TE:
        raise FlagError("--transformer-impl transformer_engine (Megatron's default) needs Transformer Engine, which "
                        "does not import here: install the transformer-engine package (with its PyTorch extension), "
                        "or pass --transformer-impl local for Megatron's own layers")

"""What setup_checks.py builds during validation refuses what Megatron would refuse later, and changes nothing.

Megatron's configurations and its learning-rate scheduler are built from the validated
arguments once more, during validation (the refusals themselves, through Megatron's
parser: tests/test_megatron_asserts.py, tests/test_refusals.py). Here: the scheduler's
build fills in arguments (sample-based training's --train-iters) only on a copy, which
a later build by Megatron would otherwise read as iteration-based training; Transformer
Engine is asked for only where it does not import; a command line checked for another
machine skips the checks of this one.
"""

import argparse
from types import SimpleNamespace

import pytest

from megatron_async.megatron_lm.adapter import setup_checks
from megatron_async.megatron_lm.safety.failures import FlagError


def _parsed(argv):
    """Megatron's arguments for argv, with the defaults its validate_args fills in for the scheduler."""
    from megatron.training import arguments

    args, _ = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)).parse_known_args(argv)
    args.start_weight_decay = args.end_weight_decay = args.weight_decay
    return args


def test_the_scheduler_is_built_on_a_copy_of_the_arguments():
    from megatron.training import training

    args = _parsed(["--train-samples", "100", "--global-batch-size", "8", "--lr", "1e-3"])
    before = vars(args).copy()
    setup_checks._build_scheduler(args)
    assert vars(args) == before  # Megatron's own build fills in train_iters and lr_decay_samples
    with pytest.raises(AssertionError):
        training.get_args()  # Megatron's global arguments stay unset until Megatron sets them
    args.train_samples = None  # the negative control: the same build does check
    with pytest.raises(Exception, match="either train-iters or train-samples"):
        setup_checks._build_scheduler(args)


@pytest.mark.parametrize("impl, spec, installed, refused", [
    ("transformer_engine", None, False, True),
    ("transformer_engine", None, True, False),  # GPU machines have it: never refused there
    ("local", None, False, False),
    ("transformer_engine", ["my_specs", "local_spec"], False, False),  # the user's own layer specs
])
def test_transformer_engine_is_asked_for_only_where_it_does_not_import(monkeypatch, impl, spec, installed, refused):
    from megatron.core.extensions import transformer_engine

    monkeypatch.setattr(transformer_engine, "HAVE_TE", installed)
    args = SimpleNamespace(transformer_impl=impl, spec=spec)
    if not refused:
        setup_checks._check_transformer_engine(args)
        return
    with pytest.raises(FlagError) as error:
        setup_checks._check_transformer_engine(args)
    assert "transformer-engine" in str(error.value) and "--transformer-impl local" in str(error.value)


def test_a_command_line_for_another_machine_skips_this_machines_checks(monkeypatch):
    from megatron.core.extensions import transformer_engine

    monkeypatch.setattr(transformer_engine, "HAVE_TE", False)
    args = SimpleNamespace(transformer_impl="transformer_engine", spec=None, yaml_cfg=None)
    with setup_checks.for_another_machine():
        setup_checks.check_setup(args)  # would fail on the missing attributes if it ran
    with pytest.raises(FlagError):
        setup_checks.check_setup(args)

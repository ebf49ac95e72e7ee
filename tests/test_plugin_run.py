"""One object per training run (megatron_lm/adapter/plugin_run.py): the hooks reach the run's state
through `plugin_run.current()`, two runs share nothing, and Megatron's pickling of its
args into a checkpoint saves nothing of ours. Control: a run reached through another
args object is another run."""

import pickle
from types import SimpleNamespace

from megatron_async.megatron_lm.adapter import plugin_run, run_mode


def _args(**over):
    return SimpleNamespace(**{"pipeline_schedule": "2bw", "simulated_delay": (0,), **over})


class _Delayed:
    """Stands for the delayed run the optimizer hook builds (plugin_run.build_delayed_run)."""

    step = None


def test_two_runs_in_one_process_share_nothing():
    first_args, second_args = _args(), _args()
    first, second = plugin_run.start(first_args, _Delayed()), plugin_run.start(second_args, _Delayed())
    assert plugin_run.start(first_args) is first and plugin_run.current(first_args) is first
    assert first is not second
    for part in ("delayed", "metrics", "routing"):
        assert getattr(first, part) is not getattr(second, part), part
    first.delayed.step, first.metrics.eval = 7, ("val_loss", 7)
    first.routing.counts[1] = 3
    assert second.delayed.step is None and second.metrics.eval is None and second.routing.counts == {}
    assert plugin_run.delayed(second_args) is second.delayed


def test_a_synchronous_run_has_no_delayed_state():
    sync = plugin_run.start(_args(pipeline_schedule="1f1b"))
    assert sync.delayed is None and sync.metrics is not None
    assert run_mode.of(_args(pipeline_schedule="1f1b")).run_class() is None  # the optimizer hook builds none
    assert run_mode.of(_args(pipeline_schedule=None, simulated_delay=(1,))).run_class() is not None


def test_megatrons_pickled_args_carry_nothing_of_the_run(tmp_path):
    """Megatron saves its args in every checkpoint and loads them with torch's weights-only
    unpickler (argparse.Namespace allowed): the run must neither be saved nor stop the load."""
    import argparse

    import torch

    args = argparse.Namespace(pipeline_schedule="2bw", simulated_delay=(0,))
    plugin_run.start(args)
    run_mode.hold(args, run_mode.resolve(args))
    torch.save({"args": args}, tmp_path / "ckpt.pt")
    with torch.serialization.safe_globals([argparse.Namespace]):
        restored = torch.load(tmp_path / "ckpt.pt", weights_only=True)["args"]
    assert restored.pipeline_schedule == "2bw" and plugin_run.current(restored) is None
    assert not isinstance(getattr(restored, run_mode.MODE_ATTR), run_mode.RunMode)
    assert plugin_run.current(pickle.loads(pickle.dumps(args))) is None

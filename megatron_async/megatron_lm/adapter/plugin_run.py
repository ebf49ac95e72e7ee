"""What megatron-async holds for one Megatron training run, and the one way the hooks reach it.

A `PluginRun` is made in the optimizer hook (the first hook that runs once per run, with
its model and its optimizer), and carried by Megatron's own `args` object, which
lives exactly as long as the run. It owns the delayed run (two_bw_run.TwoBWRun under 2bw,
simulated_delay_run.SimulatedDelayRun under --simulated-delay, built whole by that hook), the
--metrics-json recorder and the MoE routing counts. Two runs in one process share
nothing of it. What belongs to the process, not a run, stays with the process: the
hooks installed into Megatron's modules (hooks.py), the launcher watch
(safety/launcher_watch.py) and the --save locks' file descriptors, which a fork
handler must find (safety/save_lock.py). Megatron pickles `args` into every checkpoint: a
PluginRun pickles as an empty set, so nothing of it is saved there and `current()` of a
loaded args object is None.
"""

from __future__ import annotations

from typing import Optional

RUN_ATTR = "megatron_async_run"


class PluginRun:
    def __init__(self, delayed=None):
        from megatron_async.megatron_lm.observability.metrics import MetricsRecorder
        from megatron_async.megatron_lm.observability.moe_routing import RoutingCounts

        self.delayed = delayed  # a runtime.DelayedRun (TwoBWRun, SimulatedDelayRun), or None (synchronous)
        self.metrics = MetricsRecorder()
        self.routing = RoutingCounts()

    def __reduce__(self):
        # saved as an empty set: nothing of the run, and a value torch's weights-only loader
        # (which Megatron loads checkpoints with) rebuilds without importing our code
        return (set, ())

    def __repr__(self) -> str:
        return f"PluginRun(delayed={self.delayed is not None})"


def start(args, delayed=None) -> PluginRun:
    """This run's object with its delayed run, made once (a second call returns the first)."""
    run = current(args)
    if run is None:
        run = PluginRun(delayed)
        setattr(args, RUN_ATTR, run)
    return run


def current(args=None) -> Optional[PluginRun]:
    """The run's object, or None before the optimizer hook made it (or outside Megatron's loop)."""
    if args is None:
        from megatron.training.global_vars import _GLOBAL_ARGS as args  # None before Megatron parsed its flags
    run = getattr(args, RUN_ATTR, None) if args is not None else None
    return run if isinstance(run, PluginRun) else None


def delayed(args=None):
    """This run's delayed run (runtime.DelayedRun), or None (a synchronous run, or no run yet)."""
    run = current(args)
    return run.delayed if run is not None else None


def build_delayed_run(args, model_chunks, make_optimizer):
    """This run's delayed mode (run_mode.py), built whole by the optimizer hook around
    `make_optimizer()` (Megatron's), or None for a synchronous run (then that call is the hook's
    to make)."""
    from megatron_async.megatron_lm.adapter import run_mode

    mode = run_mode.of(args)
    cls = mode.run_class()
    if cls is None:
        return None
    return cls.build(args, mode, model_chunks, make_optimizer)

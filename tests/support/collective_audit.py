"""Record the process group of every collective a rank runs in steady-state training.

    MEGATRON_ASYNC_AUDIT_DIR=DIR torchrun ... -m tests.support.collective_audit --gpt ARGS...

Runs `megatron_async.launch` with every torch.distributed collective wrapped. From
the start of the second training iteration until Megatron's train() returns,
each call is recorded as (name, global ranks of its group), a non-blocking one
(async_op=True) with the iterations it was posted and waited in; when train() ends each
rank writes DIR/rank<R>.json with its pipeline stage and the records. A test then
checks that no blocking collective's group holds ranks of two pipeline stages (the
claim that 2bw's steady state has no cross-stage collective it waits for), and that a
non-blocking one that does is waited iterations after it was posted. Point-to-point sends and receives
are not collectives and are not recorded.

MEGATRON_ASYNC_AUDIT_INJECT=1 adds one world all-reduce per iteration: the
negative control that shows the audit catches a cross-stage collective.
MEGATRON_ASYNC_AUDIT_MEGATRON_EXIT=1 leaves Megatron's checkpoint_and_decide_exit and its
signal check unhooked and its --exit-duration-in-mins with Megatron, so its own
per-iteration exit checks run (another negative control);
MEGATRON_ASYNC_AUDIT_UNHOOK=NAME[,NAME] leaves those hooks of megatron_lm/adapter/hooks.py unhooked
(e.g. _allreduce_word_embedding_grads: Megatron's tied-embedding all-reduce).
"""

from __future__ import annotations

import functools
import json
import os
import sys

import torch.distributed as dist

COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base", "all_gather_object",
    "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast", "broadcast_object_list",
    "reduce", "gather", "scatter", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier",
)
START_ITERATION = 2  # the first iteration builds the pipeline and its process groups

_STATE = {"recording": False, "records": [], "steps": 0}


def _group_ranks(args, kwargs) -> list[int]:
    group = kwargs.get("group")
    if group is None:
        group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


class _AuditedWork:
    """A non-blocking collective's work object that records the iteration it is waited in."""

    def __init__(self, work, timing: dict):
        self._work, self._timing = work, timing

    def wait(self, *args, **kwargs):
        self._timing["waited"] = _STATE["steps"]
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


def _wrap_collective(name: str, original):
    @functools.wraps(original)
    def recorded(*args, **kwargs):
        if _STATE["recording"]:
            _STATE["recording"] = False  # a collective built from others is recorded once
            try:
                if not kwargs.get("async_op"):
                    _STATE["records"].append((name, _group_ranks(args, kwargs)))
                    return original(*args, **kwargs)
                # (name, group, {posted, waited}): posted in one iteration, waited in a later one
                timing = {"posted": _STATE["steps"], "waited": None}
                _STATE["records"].append((name, _group_ranks(args, kwargs), timing))
                work = original(*args, **kwargs)
                # inside a coalescing manager each op returns a placeholder; the batch's own work completes
                coalesced = work is None or type(work).__name__ == "_IllegalWork"
                return work if coalesced else _AuditedWork(work, timing)
            finally:
                _STATE["recording"] = True
        return original(*args, **kwargs)

    return recorded


def unrecorded(original):
    """`original` with the audit paused while it runs: a checkpoint save, where every rank meets
    by design, is no part of the steady state the audit checks."""

    @functools.wraps(original)
    def run(*args, **kwargs):
        recording, _STATE["recording"] = _STATE["recording"], False
        try:
            return original(*args, **kwargs)
        finally:
            _STATE["recording"] = recording

    return run


def _wrap_train_step(original):
    @functools.wraps(original)
    def hooked(*args, **kwargs):
        _STATE["steps"] += 1
        if _STATE["steps"] >= START_ITERATION:
            _STATE["recording"] = True
        if os.environ.get("MEGATRON_ASYNC_AUDIT_INJECT") == "1":
            import torch

            dist.all_reduce(torch.zeros(1))  # a world all-reduce: spans every stage
        return original(*args, **kwargs)

    return hooked


def _wrap_train(original, directory: str):
    @functools.wraps(original)
    def hooked(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        finally:
            _STATE["recording"] = False
            _write(directory)

    return hooked


def _write(directory: str) -> None:
    from megatron.core import parallel_state

    if not dist.is_initialized():
        return
    rank = dist.get_rank()
    record = {"rank": rank, "stage": parallel_state.get_pipeline_model_parallel_rank(),
              "steps": _STATE["steps"], "records": _STATE["records"]}
    with open(os.path.join(directory, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)


def install(directory: str) -> None:
    import megatron.training.training as training

    for module in (dist, dist.distributed_c10d):
        for name in COLLECTIVES:
            if hasattr(module, name):
                setattr(module, name, _wrap_collective(name, getattr(module, name)))
    training.train_step = _wrap_train_step(training.train_step)
    training.train = _wrap_train(training.train, directory)
    os.makedirs(directory, exist_ok=True)


def main() -> int:
    from megatron_async import launch
    from megatron_async.megatron_lm.adapter.hooks import install as install_plugin

    unhooked = {name for name in os.environ.get("MEGATRON_ASYNC_AUDIT_UNHOOK", "").split(",") if name}
    import dataclasses

    if os.environ.get("MEGATRON_ASYNC_AUDIT_MEGATRON_EXIT") == "1":  # Megatron's own exit checks, unhooked
        from megatron_async.pipeline import stop_agreement

        unhooked |= {"checkpoint_and_decide_exit", "signals_received"}
        stop_agreement.MEGATRON_DURATION = dataclasses.replace(stop_agreement.MEGATRON_DURATION,
                                                               wrap=lambda original: original)
    if unhooked:
        from megatron_async.megatron_lm.adapter import hooks

        hooks.HOOKS = tuple(dataclasses.replace(h, wrap=lambda original: original)
                            if h.name in unhooked else h for h in hooks.HOOKS)
    install_plugin()  # the plugin's hooks first, so the audit wraps what Megatron calls
    install(os.environ["MEGATRON_ASYNC_AUDIT_DIR"])
    return launch.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())

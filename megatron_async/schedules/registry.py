"""Schedule registry: one name per pipeline schedule, selected by `--pipeline-schedule`.

A schedule may carry a Megatron-style forward-backward function (what the trainer
runs), an action-list generator (what the validator and simulator read), or both; one
that our own runtime trains also says what that runtime needs (its runner, the run
class that drives it inside Megatron's loop, the weight versions a stage keeps, the flag
checks it refuses with). The flag checks, the Megatron hooks, the planner, the save-space
check and the simulator read these fields, never the schedule's name. Functions are given
as "module:attribute" strings and imported on first use, so the simulator and validator
stay importable without Megatron-Core or torch.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, replace
from typing import Callable, Optional, Union

from megatron_async.schedules.builtin import BUILTIN_SCHEDULES

FuncRef = Union[str, Callable, None]


@dataclass(frozen=True)
class ScheduleSpec:
    name: str
    description: str = ""
    forward_backward_func: FuncRef = None  # Megatron signature: (*, forward_step_func, data_iterator, model, ...)
    generator: FuncRef = None  # (num_stages, num_microbatches, num_batches) -> per-stage action lists
    # the same, for what the schedule runs with Megatron's --overlap-moe-expert-parallel-comm:
    # combined forward-backward steps (actions.ForwardBackward); a runtime that cannot run them
    # refuses the flag in its flag_checks
    ep_overlap_generator: FuncRef = None
    runtime: FuncRef = None  # a persistent pipeline runner class (asynchronous schedules such as 2bw)
    # the class that hands `runtime` this schedule's lists one batch at a time: (num_stages,
    # num_microbatches, num_batches, first_batch=, generator=) -> .actions(stage), .segment(stage, b)
    stream: FuncRef = None
    requires_pipeline: bool = False  # True: only meaningful with PP > 1
    run: FuncRef = None  # the class that drives `runtime` in Megatron's loop: built by the optimizer hook
    weight_versions: int = 1  # weight versions a stage keeps: the live ones, plus a stash of the others
    flag_checks: FuncRef = None  # (args) -> None: refuses, naming the flag, what the runtime cannot honour
    flag_defaults: Union[str, tuple, None] = None  # rows of Megatron defaults the runtime replaces (flags.py)
    megatron_layout: Optional[str] = None  # a Megatron function's layout, the one Megatron picks it for

    @property
    def stash_copies(self) -> int:
        """Copies of the weights a stage stashes beside the live ones."""
        return self.weight_versions - 1

    def runner_class(self) -> Optional[Callable]:
        """The persistent pipeline runner of this schedule (None: none of ours)."""
        return _resolve(self.runtime)

    def action_generator(self, ep_overlap: bool = False) -> Optional[Callable]:
        """This schedule's action-list generator; with `ep_overlap`, the one for Megatron's
        --overlap-moe-expert-parallel-comm (combined steps). None: it has none."""
        return _resolve(self.ep_overlap_generator if ep_overlap else self.generator)

    def stream_for(self, num_stages: int, num_microbatches: int, num_batches: int, first_batch: int = 0,
                   ep_overlap: bool = False):
        """The lists `runtime` executes for a run of `num_batches` batches from `first_batch`:
        this schedule's generator (with `ep_overlap`, its combined-step one), streamed by its
        `stream` class."""
        generator = self.action_generator(ep_overlap)
        if generator is None and ep_overlap:  # never the plain lists in their place
            raise ValueError(f"pipeline schedule {self.name!r} has no action lists with "
                             "--overlap-moe-expert-parallel-comm")
        return _resolve(self.stream)(num_stages, num_microbatches, num_batches, first_batch=first_batch,
                                     generator=generator)

    def run_class(self) -> Optional[Callable]:
        """The class that trains this schedule in Megatron's loop (None: Megatron's own function)."""
        return _resolve(self.run)

    def check_flags(self, args) -> None:
        """Refuse what this schedule's runtime cannot honour (FlagError, naming the flag)."""
        check = _resolve(self.flag_checks)
        if check is not None:
            check(args)

    def default_rows(self) -> tuple:
        """The rows of Megatron defaults this schedule's runtime replaces."""
        return _resolve(self.flag_defaults) or ()


# Megatron's own choice when no --pipeline-schedule is given: nothing of ours to run or check
MEGATRON_DEFAULT = ScheduleSpec(name="megatron")


_REGISTRY: dict[str, ScheduleSpec] = {}


def _resolve(ref):
    """The object a "module:attribute" string names (anything else as it is)."""
    if not isinstance(ref, str):
        return ref
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def register_schedule(name: str, **fields) -> ScheduleSpec:
    """Register `name`, or update the given fields of an existing registration."""
    _load_builtins()
    spec = _REGISTRY.get(name)
    spec = replace(spec, **fields) if spec else ScheduleSpec(name=name, **fields)
    _REGISTRY[name] = spec
    return spec


def unregister_schedule(name: str) -> None:
    """Remove `name` (a plugin that registered a schedule for one use takes it away again)."""
    _REGISTRY.pop(name, None)


def available_schedules() -> list[str]:
    _load_builtins()
    return sorted(_REGISTRY)


def get_schedule(name: str) -> ScheduleSpec:
    _load_builtins()
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown pipeline schedule {name!r} (--pipeline-schedule); "
            f"registered: {', '.join(sorted(_REGISTRY))}"
        )
    return _REGISTRY[name]


def get_forward_backward_func(name: str) -> Callable:
    """The function the trainer calls once per iteration for schedule `name`."""
    spec = get_schedule(name)
    func = _resolve(spec.forward_backward_func)
    if func is None:
        raise ValueError(f"pipeline schedule {name!r} has no runtime; it can only be simulated")
    return func


def schedule_or_default(name: Optional[str]) -> ScheduleSpec:
    """The spec of `--pipeline-schedule name`, or MEGATRON_DEFAULT for none and for a name not
    registered (the flag check refuses those, naming the flag)."""
    _load_builtins()
    return _REGISTRY.get(name, MEGATRON_DEFAULT) if name else MEGATRON_DEFAULT


def megatron_schedule(layout: str) -> Optional[str]:
    """The registered name of the function Megatron runs for `layout`."""
    return next((name for name in available_schedules() if _REGISTRY[name].megatron_layout == layout), None)


def get_schedule_generator(name: str, ep_overlap: bool = False) -> Callable:
    """The action-list generator of schedule `name` (for validator, simulator, executor); with
    `ep_overlap`, the one for Megatron's --overlap-moe-expert-parallel-comm."""
    spec = get_schedule(name)
    gen = spec.action_generator(ep_overlap)
    if gen is None and ep_overlap:
        paired = [n for n in available_schedules() if _REGISTRY[n].ep_overlap_generator is not None]
        raise ValueError(f"pipeline schedule {name!r} has no action lists with --overlap-moe-expert-parallel-comm "
                         f"(combined forward-backward steps); these have: {', '.join(paired) or 'none'}")
    if gen is None:
        raise ValueError(f"pipeline schedule {name!r} has no action-list generator")
    return gen


_BUILTINS_LOADED = False


def _load_builtins() -> None:
    global _BUILTINS_LOADED
    if not _BUILTINS_LOADED:
        _BUILTINS_LOADED = True
        for name, fields in BUILTIN_SCHEDULES.items():
            register_schedule(name, **fields)

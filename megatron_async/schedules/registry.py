"""Schedule registry: one name per pipeline schedule, selected by `--pipeline-schedule`.

A schedule may carry a Megatron-style forward-backward function (what the trainer
runs), an action-list generator (what the validator and simulator read), or both.
Functions are given as "module:attribute" strings and imported on first use, so the
simulator and validator stay importable without Megatron-Core or torch.
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
    runtime: FuncRef = None  # a persistent pipeline runner class (asynchronous schedules such as 2bw)
    requires_pipeline: bool = False  # True: only meaningful with PP > 1
    asynchronous: bool = False  # True: weights are updated without a pipeline flush (delayed gradients)


_REGISTRY: dict[str, ScheduleSpec] = {}


def _resolve(ref: FuncRef) -> Optional[Callable]:
    if ref is None or callable(ref):
        return ref
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def register_schedule(name: str, **fields) -> ScheduleSpec:
    """Register `name`, or update the given fields of an existing registration."""
    spec = _REGISTRY.get(name)
    spec = replace(spec, **fields) if spec else ScheduleSpec(name=name, **fields)
    _REGISTRY[name] = spec
    return spec


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


def get_runtime(name: str) -> Callable:
    """The persistent runner class of an asynchronous schedule (e.g. `2bw`)."""
    spec = get_schedule(name)
    runtime = _resolve(spec.runtime)
    if runtime is None:
        raise ValueError(f"pipeline schedule {name!r} has no persistent runtime")
    return runtime


def delayed_runtime(name: Optional[str]) -> bool:
    """True for a schedule our persistent runtime trains with delayed weights (2bw): the flag
    checks, the Megatron hooks and the planner follow this, not the schedule's name. False
    for no schedule and for a name not registered (the flag check names those)."""
    _load_builtins()
    spec = _REGISTRY.get(name) if name else None
    return bool(spec and spec.runtime is not None and spec.asynchronous)


def is_runnable(name: str) -> bool:
    """True if the trainer can run `name` (a Megatron function or our runtime)."""
    spec = get_schedule(name)
    return spec.forward_backward_func is not None or spec.runtime is not None


def get_schedule_generator(name: str) -> Callable:
    """The action-list generator of schedule `name` (for validator, simulator, executor)."""
    spec = get_schedule(name)
    gen = _resolve(spec.generator)
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

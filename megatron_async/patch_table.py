"""Every replacement the plugin makes in code it does not own, as declared tables.

A `Patch` names its target (an attribute of a module, of a class, or of an object handed
to the installer), the replacement (made from the original), its scope (when it acts),
where the target is called, and how it is undone. `install` applies a table, checking
every target first so that a missing one changes nothing, and records what it replaced;
`restore` puts back exactly what was there before, in reverse order.

The tables: the Megatron hooks (megatron_lm/adapter/hooks.py), the CUDA emulation
(cpu.py), the NCCL emulation (cpu_nccl.py) and the patches of delayed runs
(pipeline/delayed_run_patches.py: the optimizer's, the stop agreement's). tests/test_hook_scope.py compares every function in the
touched namespaces before and after installing them.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib
from dataclasses import dataclass
from typing import Any, Callable, Optional


class Scope(enum.Enum):
    """When a patch acts (an installed hook outside its scope calls the original unchanged)."""

    EVERY_RUN = "every run"
    DELAYED = "delayed runs only"
    CPU = "CPU only"


class _Absent:
    def __repr__(self) -> str:
        return "ABSENT"


ABSENT = _Absent()  # the original of an attribute the target lacked (a patch that defines it)


@dataclass(frozen=True)
class Patch:
    module: str  # the target's owner: "package.module", "package.module:Class", or "<name>" for an object
    name: str  # the attribute replaced (for a `mode` patch: what it is)
    called_at: str  # who calls it and why it is replaced
    wrap: Callable[[Any], Any]  # original -> replacement (returning the original: left alone)
    scope: Scope
    also: tuple = ()  # owners given the same replacement (a function two modules export)
    optional: bool = False  # a target that may be missing (its module too): `wrap` gets ABSENT, not refused
    restore: Optional[Callable[[Any, Any], None]] = None  # (owner, original) -> None; default: setattr back

    @property
    def target(self) -> str:
        return f"{self.module.replace(':', '.')}.{self.name}"


class MissingTargetError(RuntimeError):
    """A table names an attribute that is not there (another version of the patched code)."""

    def __init__(self, patch: Patch, why: str):
        super().__init__(why)
        self.patch = patch


def resolve(path: str, objects: Optional[dict] = None):
    """A module, a class in one ("package.module:Class"), or an object handed in ("<name>")."""
    if path.startswith("<"):
        return (objects or {})[path]
    module_name, _, class_name = path.partition(":")
    owner = importlib.import_module(module_name)
    for part in filter(None, class_name.split(".")):
        owner = getattr(owner, part)
    return owner


def _raw(owner, name: str):
    """What the owner itself holds under `name` (a class's staticmethod as such); ABSENT if inherited or missing."""
    try:
        return vars(owner).get(name, ABSENT)
    except TypeError:  # no __dict__
        return getattr(owner, name, ABSENT)


def check(patches, objects: Optional[dict] = None) -> list:
    """Each patch with its owners, resolved; MissingTargetError names the first one missing."""
    resolved = []
    for patch in patches:
        try:
            owners = [resolve(path, objects) for path in (patch.module, *patch.also)]
        except (ImportError, AttributeError, KeyError) as err:
            if patch.optional:
                continue
            raise MissingTargetError(patch, f"cannot import {patch.module} ({err})") from None
        if patch.restore is None and not patch.optional and not all(hasattr(o, patch.name) for o in owners):
            raise MissingTargetError(patch, f"{patch.target} does not exist")
        resolved.append((patch, owners))
    return resolved


def install(patches, installed: list, objects: Optional[dict] = None) -> list:
    """Apply `patches` (all checked first), appending to `installed` what `restore` needs.
    Returns the patches applied (one whose replacement is its original is skipped).
    A patch with its own `restore` is no attribute: its `wrap(owner)` makes the change and
    returns what its `restore(owner, ...)` needs to undo it (None: it changed nothing)."""
    applied = []
    for patch, owners in check(patches, objects):
        if patch.restore is not None:
            undo = patch.wrap(owners[0])
            if undo is not None:  # None: nothing to change here
                installed.append((patch, owners[0], undo))
                applied.append(patch)
            continue
        original = getattr(owners[0], patch.name, ABSENT)
        replacement = patch.wrap(original)
        if replacement is original:
            continue
        for owner in owners:
            installed.append((patch, owner, _raw(owner, patch.name)))
            setattr(owner, patch.name, replacement)
        applied.append(patch)
    return applied


def restore(installed: list) -> None:
    """Undo what `install` recorded in `installed`, last first, and empty it."""
    while installed:
        patch, owner, before = installed.pop()
        if patch.restore is not None:
            patch.restore(owner, before)
        elif before is ABSENT:
            delattr(owner, patch.name)
        else:
            setattr(owner, patch.name, before)


def bound(patch: Patch, **values) -> Patch:
    """The table's entry with a run's values given to its `wrap` (a stage count, a norm's state)."""
    return dataclasses.replace(patch, wrap=functools.partial(patch.wrap, **values))


def rows(patches) -> list:
    """A table's documentation: (target, scope, where it is called and why)."""
    return [(", ".join([p.target, *(f"{a.replace(':', '.')}.{p.name}" for a in p.also)]), p.scope.value, p.called_at)
            for p in patches]

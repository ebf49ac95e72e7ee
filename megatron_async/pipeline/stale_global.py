"""`--clip-grad-mode stale-global`: clip by the previous step's global gradient norm.

A global norm over all pipeline stages needs a reduction across stages; done
synchronously at every step it makes every stage wait for the slowest, which is
the bubble 2BW removes. Here each stage starts a non-blocking all-reduce of its
squared stage-local norm at step t and consumes the result at step t+1, when it
has long arrived, so step t+1 clips by the global norm of step t. Step 0 has no
previous global norm and clips by its stage-local norm.

It plugs into Megatron's optimizer at its one norm function
(`get_grad_norm_fp32` in megatron.core.optimizer.optimizer, its STALE_GLOBAL_NORM entry of the
delayed-run patches, pipeline/delayed_run_patches.py, installed for the length of one step): every call inside a
step is answered with the stale global value of the same call one step earlier,
so chained optimizers with several norm groups each get their own.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
from typing import Iterator

import torch
import torch.distributed as dist

from megatron_async import patch_table
from megatron_async.patch_table import Patch, Scope

HISTORY_STEPS = 1000


def _stale_global_norm(original, norm: "StaleGlobalNorm"):
    """Each norm Megatron computes in this step answered with the previous step's global one."""

    @functools.wraps(original)
    def answered(*args, **kwargs):
        return norm.answer(original(*args, **kwargs))

    return answered


STALE_GLOBAL_NORM = Patch(
    "megatron.core.optimizer.optimizer", "get_grad_norm_fp32", "--clip-grad-mode stale-global, for one optimizer "
    "step: every norm of the step answered with the global norm of the step before", _stale_global_norm,
    Scope.DELAYED)


class _Arrived:
    """A finished reduction (restored from a checkpoint)."""

    def wait(self) -> None:
        return None


class StaleGlobalNorm:
    """Per-stage state of the stale global norm (one instance per process)."""

    def __init__(self, pipeline_group: dist.ProcessGroup, device: torch.device | None = None):
        self.group = pipeline_group
        # the norms are host scalars: on a host (gloo) group they add no GPU kernel, and no
        # whole-device wait at a step end waits for the other stages' steps (NCCL would)
        self.device = device if device is not None else torch.device("cpu")
        self._pending: list = []  # previous step's (work, squared-norm tensor) per call
        self._current: list = []
        self._calls = 0
        # Norm used for clipping and stage-local norm, per step and call, for the
        # recent steps only (a long run must not grow them).
        self.used: collections.deque = collections.deque(maxlen=HISTORY_STEPS)
        self.local: collections.deque = collections.deque(maxlen=HISTORY_STEPS)

    def answer(self, local_norm: float) -> float:
        index = self._calls
        self._calls += 1
        squared = torch.tensor([float(local_norm) ** 2], dtype=torch.float64, device=self.device)
        work = dist.all_reduce(squared, group=self.group, async_op=True)
        self._current.append((work, squared))
        self.local[-1].append(float(local_norm))
        if index < len(self._pending):
            prev_work, prev_squared = self._pending[index]
            prev_work.wait()
            value = math.sqrt(prev_squared.item())
        else:
            value = float(local_norm)
        self.used[-1].append(value)
        return value

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Wrap one optimizer step: Megatron's norm function answers with stale global norms."""
        self._calls, self._current = 0, []
        self.used.append([])
        self.local.append([])
        installed: list = []
        patch_table.install((patch_table.bound(STALE_GLOBAL_NORM, norm=self),), installed)
        try:
            yield
        finally:
            patch_table.restore(installed)
            for work, _ in self._pending[len(self._current):]:
                work.wait()  # calls that did not recur this step
            self._pending = self._current

    def state_dict(self) -> dict:
        """The squared global norms the next step clips by (a checkpoint's part of the
        run: without them a resumed run's first step would clip stage-locally)."""
        for work, _ in self._pending:
            work.wait()
        return {"squared": [float(squared.item()) for _, squared in self._pending]}

    def load_state_dict(self, state: dict) -> None:
        self._pending = [(_Arrived(), torch.tensor([value], dtype=torch.float64, device=self.device))
                         for value in state.get("squared", [])]

    def finish(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending = []

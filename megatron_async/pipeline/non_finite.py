"""Stop a run at the first non-finite loss or gradient norm, before it is checkpointed.

A diverged run (a learning rate too high, a bad batch) otherwise trains to the end
on NaN weights, exits 0 and saves a checkpoint of NaNs. Each stage decides from its
own numbers: its stage-local gradient norm (the one Megatron's optimizer computed
for clipping, or, when clipping is off, the same norm computed here over the
stage's own ranks) and, on the last stage, the microbatch losses. No collective
spans two pipeline stages; the stage that sees it first raises, and the launcher
(torchrun, srun --kill-on-bad-exit) ends the others.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Callable, Iterable, Optional

import torch


class NonFiniteError(RuntimeError):
    """Training produced a NaN or infinite loss or gradient norm."""


def _sub_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def reports_grad_norm(optimizer) -> bool:
    """Whether Megatron's step returns a real gradient norm: a chained optimizer always
    computes one; a single optimizer only when it clips (else it returns None, or 0.0
    in its mixed-precision variant)."""
    if hasattr(optimizer, "chained_optimizers"):
        return True
    config = getattr(optimizer, "config", None)
    return config is not None and config.clip_grad > 0.0


def step_grad_norm(optimizer, returned: Optional[float]) -> float:
    """The gradient norm of the step just taken, over the ranks its statistics use.

    Call after `optimizer.step()` and before the gradients are zeroed.
    """
    if returned is not None and reports_grad_norm(optimizer):
        return float(returned)
    return float(optimizer.get_grad_norm())


def check_finite(iteration: int, stage: int, grad_norm: Optional[float],
                 losses: Iterable[float] = ()) -> None:
    """Raise NonFiniteError naming `iteration` (1-based) and `stage` if anything is not finite."""
    if grad_norm is not None and not math.isfinite(grad_norm):
        raise NonFiniteError(
            f"iteration {iteration}: gradient norm {grad_norm} on pipeline stage {stage}; the run is "
            "stopped before any checkpoint of these weights is written (lower --lr, or clip with --clip-grad)")
    for loss in losses:
        if not math.isfinite(loss):
            raise NonFiniteError(
                f"iteration {iteration}: loss {loss} on pipeline stage {stage}; the run is stopped "
                "before any checkpoint of these weights is written (lower --lr, or clip with --clip-grad)")


def report_losses(reports: list[dict]) -> list[float]:
    """Per-microbatch loss sums of Megatron loss reports ({'lm loss': [sum, count]})."""
    values = []
    for report in reports:
        for value in report.values():
            values.append(float(torch.as_tensor(value).reshape(-1)[0]))
    return values


class LossFlag:
    """Whether a batch's losses are all finite, read after the step without a device wait.

    Made on the device before the optimizer step and copied to pinned host memory
    behind an event. The step's own gradient-norm read (Megatron's `get_grad_norm`)
    waits for the device anyway, so the read after the step finds the copy done:
    the last stage does not block once per microbatch on `float(loss)` after the
    step, which would wait for the optimizer and stash kernels too.
    """

    def __init__(self, reports: list[dict]):
        self.reports = reports
        values = [torch.as_tensor(v).reshape(-1)[0].float() for r in reports for v in r.values()]
        self._host, self._event = None, None
        if not values:
            return
        finite = torch.isfinite(torch.stack(values)).all()
        if finite.is_cuda:
            self._host = torch.empty((), dtype=torch.bool, pin_memory=True)
            self._host.copy_(finite, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = finite

    def all_finite(self) -> bool:
        if self._host is None:
            return True
        if self._event is not None:
            self._event.synchronize()
        return bool(self._host)


# Megatron's own check (rerun state machine, --check-for-nan-in-loss-and-grad) raises
# "Rank R, node N, device D, iteration I: Unexpected result nan (message='...')".
_MEGATRON_CHECK = re.compile(r"Unexpected result (\S+) \(message='(.*)'\)")


def megatron_check_as_ours(func: Callable, iteration: Callable[[], int], stage: Callable[[], int]) -> Callable:
    """`func` (a forward-backward function) with Megatron's non-finite check reported as
    ours: the pipeline stage and the iteration the metrics file gives, not a rank."""

    @functools.wraps(func)
    def checked(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except RuntimeError as err:
            found = _MEGATRON_CHECK.search(str(err))
            if found is None:
                raise
            value, what = found.groups()
            raise NonFiniteError(
                f"iteration {iteration()}: {what} ({value}) on pipeline stage {stage()}; the run is stopped "
                "before any checkpoint of these weights is written (lower --lr, or clip with --clip-grad)") from err

    return checked


def check_train_step(result: tuple, optimizer, iteration: int, stage: int) -> None:
    """After Megatron's train_step (while main_grad still holds the step's gradients):
    its losses (last stage) and the step's gradient norm must be finite."""
    loss_dict, skipped, grad_norm = result[0], result[1], result[5]
    losses = [float(torch.as_tensor(v).reshape(-1)[0]) for v in (loss_dict or {}).values()]
    norm = None
    if not skipped:
        norm = float(grad_norm) if grad_norm is not None else float(optimizer.get_grad_norm())
    check_finite(iteration, stage, norm, losses)

"""One stop iteration for every rank, agreed without a blocking collective across stages.

Megatron decides `--exit-signal-handler` and `--exit-duration-in-mins` with a blocking
gather (all-reduce) over every rank each iteration. Under 2bw the stages are up to one
step apart, so that collective would make each stage wait for the slowest every
iteration. Under the agreement Megatron's signal check answers no (the hook on
DistributedSignalHandler.signals_received, megatron_lm/adapter/hooks.py), and the
agreement keeps --exit-duration-in-mins for the run (MEGATRON_DURATION, restored when it
settles), so that Megatron's inline duration checks, in training and in evaluation, do
not run. Instead, after iteration i every rank posts a non-blocking MAX all-reduce
of its own stop code (0: go on; 1: a signal arrived here; 2: the duration is up) on a
host (gloo) group of its own (a CPU scalar: no GPU kernel, no device sync), and reads
the one it posted LAG iterations earlier. Every rank has long posted that one (no
stage is more than one step behind another), so the read does not wait, and every
rank reads the same value after the same iteration: they all stop at one iteration
boundary, LAG iterations after the first rank saw the signal or the clock.
"""

from __future__ import annotations

import time
from collections import deque

import torch
import torch.distributed as dist

from megatron_async import patch_table
from megatron_async.patch_table import Patch, Scope

LAG = 2  # iterations between posting a stop code and reading the agreed one
GO_ON, SIGNAL, DURATION = 0, 1, 2
REASONS = {SIGNAL: "a signal arrived (--exit-signal-handler)", DURATION: "--exit-duration-in-mins is up"}


MEGATRON_DURATION = Patch(
    "<args>", "exit_duration_in_mins", "under 2bw with a stop agreement: kept by the agreement, so that Megatron's "
    "checks in checkpoint_and_decide_exit and evaluate (a world all-reduce each iteration) do not run",
    lambda original: None, Scope.DELAYED)


class StopAgreement:
    """The agreement's group, the codes posted and not yet read, and the run's duration."""

    def __init__(self, group, device, lag: int = LAG):
        self.group, self.device, self.lag = group, device, lag
        self._pending: deque = deque()  # (iteration, work, tensor)
        self.duration_mins = None
        self._installed: list = []

    def take_over(self, args) -> None:
        """Megatron's --exit-duration-in-mins becomes the agreement's until it settles."""
        self.duration_mins = args.exit_duration_in_mins
        patch_table.install((MEGATRON_DURATION,), self._installed, {"<args>": args})

    def own_code(self, args) -> int:
        """This rank's own reason to stop: a signal Megatron's handler caught here, or the clock."""
        from megatron.training import training
        from megatron.training.global_vars import get_signal_handler

        if args.exit_signal_handler and getattr(get_signal_handler(), "_signal_received", False):
            return SIGNAL
        if self.duration_mins and (time.time() - training._TRAIN_START_TIME) / 60.0 > self.duration_mins:
            return DURATION
        return GO_ON

    def after_iteration(self, iteration: int, code: int) -> tuple[int, int]:
        """Post this rank's code for `iteration`; returns (agreed code, the iteration it
        was posted at) for the code posted `lag` iterations ago, or (GO_ON, -1)."""
        tensor = torch.tensor([code], dtype=torch.int32, device=self.device)
        work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        self._pending.append((iteration, work, tensor))
        if len(self._pending) <= self.lag:
            return GO_ON, -1
        posted, work, tensor = self._pending.popleft()
        work.wait()
        return int(tensor.item()), posted

    def settle(self) -> None:
        """Wait for the codes still posted (all ranks stop at the same iteration, so each
        has posted the same ones): no collective is left unmatched at exit."""
        while self._pending:
            _posted, work, _tensor = self._pending.popleft()
            work.wait()
        patch_table.restore(self._installed)

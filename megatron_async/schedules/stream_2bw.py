"""2bw action lists produced one batch at a time, for runs of any length.

The 2bw generators (gen_2bw.py; gen_2bw_paired.py, with combined steps) build whole-run
lists; a 100k-iteration run would spend minutes and gigabytes on them before its first
step. But 2bw has no flush, so
after the first batch every batch repeats the same actions with its numbers moved:
the list of a long run is the first batch's segment, one steady segment relabelled
for each following batch, the last batch's segment and the cool-down. This module
cuts those pieces from the generator's own lists for a short run and relabels them,
so the executor, the validator and the simulator all read the generator's actions;
`tests/test_schedule_stream.py` checks the stream equals the generator's lists.

A segment is a stage's actions from just after OptimizerStep(b-1) through
OptimizerStep(b).
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

from megatron_async.schedules.actions import Action, Backward, Forward, ForwardBackward, OptimizerStep
from megatron_async.schedules.gen_2bw import two_bw, version_2bw
from megatron_async.schedules.gen_2bw_paired import two_bw_paired

TEMPLATE_BATCHES = 5  # head, three steady segments, last: enough for the pattern to settle


def shift(actions, batches: int, m: int) -> list[Action]:
    """The same actions `batches` batches later (microbatches, versions, steps relabelled)."""
    if batches == 0:
        return list(actions)
    offset = batches * m
    moved = []
    def move(a):
        k = a.microbatch + offset
        return type(a)(k, version_2bw(k, m))

    for a in actions:
        if isinstance(a, (Forward, Backward)):
            moved.append(move(a))
        elif isinstance(a, ForwardBackward):
            moved.append(ForwardBackward(move(a.forward), move(a.backward)))
        elif isinstance(a, OptimizerStep):
            moved.append(OptimizerStep(a.step + batches))
        else:  # communication
            moved.append(dataclasses.replace(a, microbatch=a.microbatch + offset))
    return moved


def split_segments(actions: list[Action]) -> tuple[list[list[Action]], list[Action]]:
    """(one segment per OptimizerStep, the actions after the last step)."""
    segments, current = [], []
    for a in actions:
        current.append(a)
        if isinstance(a, OptimizerStep):
            segments.append(current)
            current = []
    return segments, current


class TwoBWStream:
    """The 2bw lists of a run of `batches` batches, numbered from `first_batch` (a
    resumed run), one segment at a time; nothing is built for the whole run. `generator`:
    a schedule's own generator of lists with 2bw's versions and no flush (default: 2bw's;
    `paired`: the lists with combined forward-backward steps, gen_2bw_paired)."""

    def __init__(self, num_stages: int, microbatches: int, batches: int, first_batch: int = 0,
                 paired: bool = False, generator=None):
        self.p, self.m, self.n, self.first = num_stages, microbatches, batches, first_batch
        generator = generator or (two_bw_paired if paired else two_bw)
        template = generator(num_stages, microbatches, min(batches, TEMPLATE_BATCHES))
        self._pieces = [split_segments(actions) for actions in template]

    def segment(self, stage: int, b: int) -> list[Action]:
        """Stage `stage`'s actions ending with its OptimizerStep(first_batch + b)."""
        if not 0 <= b < self.n:
            raise IndexError(f"batch {b} is outside the run's {self.n} batches")
        segments, _ = self._pieces[stage]
        if self.n <= TEMPLATE_BATCHES or b == 0:
            piece, moved = segments[b], 0
        elif b == self.n - 1:  # no next batch to warm up: the template's last segment
            piece, moved = segments[-1], self.n - TEMPLATE_BATCHES
        else:
            piece, moved = segments[1], b - 1
        return shift(piece, self.first + moved, self.m)

    def tail(self, stage: int) -> list[Action]:
        """What stage `stage` runs after its last optimizer step (trailing sends)."""
        _, tail = self._pieces[stage]
        return shift(tail, self.first + max(self.n - TEMPLATE_BATCHES, 0), self.m)

    def actions(self, stage: int) -> Iterator[Action]:
        """Stage `stage`'s whole list, produced as it is consumed."""
        for b in range(self.n):
            yield from self.segment(stage, b)
        yield from self.tail(stage)

    def lists(self) -> list[list[Action]]:
        """Every stage's whole list (for the validator and simulator on short runs)."""
        return [list(self.actions(s)) for s in range(self.p)]

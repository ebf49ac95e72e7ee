"""Shared pieces of the generators: the 1F1B compute order and communication placement.

Generators describe only the compute order of each stage (forwards, backwards,
optimizer steps). `add_communication` then inserts the sends and receives those
imply: a send right after the compute that produced the tensor, a receive right
before the compute that consumes it, so the communication between two compute
actions forms one run. Inside each run it picks the order by replaying the whole
pipeline with rendezvous semantics (a send and its receive happen together), so
every stage's list is a slice of one global execution and blocking p2p cannot
deadlock (see `actions` for the executor contract).
"""

from __future__ import annotations

from typing import Iterable, Sequence

from megatron_async.schedules.actions import (
    Action,
    Backward,
    Compute,
    Forward,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
    matches,
)


def check_sizes(num_stages: int, microbatches: int, batches: int) -> None:
    for flag, value in (("pipeline stages", num_stages), ("microbatches per batch", microbatches),
                        ("batches", batches)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"number of {flag} must be a positive integer, got {value!r}")


def one_f_one_b(microbatches: Sequence[int], warmup: int) -> list[tuple[str, int]]:
    """1F1B order over `microbatches`: `warmup` forwards, then forward/backward pairs,
    then the remaining backwards. Entries are ("F" | "B", microbatch)."""
    mbs = list(microbatches)
    warmup = min(warmup, len(mbs))
    order = [("F", k) for k in mbs[:warmup]]
    for i, k in enumerate(mbs[warmup:]):
        order += [("F", k), ("B", mbs[i])]
    order += [("B", k) for k in mbs[len(mbs) - warmup:]]
    return order


def _needs(action: Compute, stage: int, last: int) -> list[Action]:
    """Receives that must precede `action` at `stage`."""
    if isinstance(action, Forward) and stage > 0:
        return [RecvActivation(action.microbatch, stage - 1)]
    if isinstance(action, Backward) and stage < last:
        return [RecvGrad(action.microbatch, stage + 1)]
    return []


def _produces(action: Compute, stage: int, last: int) -> list[Action]:
    """Sends that follow `action` at `stage`."""
    if isinstance(action, Forward) and stage < last:
        return [SendActivation(action.microbatch, stage + 1)]
    if isinstance(action, Backward) and stage > 0:
        return [SendGrad(action.microbatch, stage - 1)]
    return []


def _segments(compute: Sequence[Iterable[Compute]]) -> list[list[tuple[str, object]]]:
    """Per stage: compute actions, and between them the run of sends of the previous
    compute plus receives of the next one, as ("compute", action) / ("comm", [actions])."""
    last = len(compute) - 1
    segments = []
    for s, acts in enumerate(compute):
        segs, pending = [], []
        for a in acts:
            run = pending + _needs(a, s, last)
            if run:
                segs.append(("comm", run))
            segs.append(("compute", a))
            pending = _produces(a, s, last)
        if pending:
            segs.append(("comm", pending))
        segments.append(segs)
    return segments


def add_communication(compute: Sequence[Iterable[Compute]]) -> list[list[Action]]:
    """Full action lists from per-stage compute orders (see module docstring)."""
    segments = _segments(compute)
    stages = range(len(segments))
    out: list[list[Action]] = [[] for _ in stages]
    pos = [0] * len(segments)  # current segment per stage
    runs = [None] * len(segments)  # unmatched actions of the run a stage is in

    def current_run(s):
        if runs[s] is None and pos[s] < len(segments[s]) and segments[s][pos[s]][0] == "comm":
            runs[s] = list(segments[s][pos[s]][1])
        return runs[s] or []

    def leave_run_if_done(s):
        if runs[s] == []:
            runs[s] = None
            pos[s] += 1

    def advance(s):
        """Run stage s until it waits for a peer; each match happens at both ends at once."""
        while pos[s] < len(segments[s]):
            kind, item = segments[s][pos[s]]
            if kind == "compute":
                out[s].append(item)
                pos[s] += 1
                continue
            run = current_run(s)
            for a in list(run):
                peer_run = current_run(a.peer)
                other = next((b for b in peer_run if matches(a, s, b, a.peer)), None)
                if other is not None and other.microbatch == a.microbatch:
                    out[s].append(a)
                    out[a.peer].append(other)
                    run.remove(a)
                    peer_run.remove(other)
                    leave_run_if_done(a.peer)
            if run:
                return
            leave_run_if_done(s)

    while True:
        before = list(pos), [len(o) for o in out]
        for s in stages:
            advance(s)
        if all(pos[s] == len(segments[s]) for s in stages):
            return out
        if before == (list(pos), [len(o) for o in out]):
            stuck = {s: segments[s][pos[s]] for s in stages if pos[s] < len(segments[s])}
            raise RuntimeError(f"compute orders cannot be connected without deadlock: {stuck}")

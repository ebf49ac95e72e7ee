"""Shared pieces of the generators: the 1F1B compute order and communication placement.

Generators describe only the compute order of each stage (forwards, backwards,
optimizer steps). `add_communication` then inserts the sends and receives those
imply: a send right after the compute that produced the tensor, a receive right
before the compute that consumes it, so the communication between two compute
actions forms one run. Inside each run it picks the order by replaying the whole
pipeline with rendezvous semantics (a send and its receive happen together), so
every stage's list is a slice of one global execution and blocking p2p cannot
deadlock (see `actions` for the executor contract).

With a `Placement` of several chunks per stage (interleaved 1F1B, ZB-V), a tensor
passed between two pieces on the same stage needs no communication, and two stages
may send to each other at the same moment, which deadlocks under rendezvous. Such
schedules are connected with buffered sends (a send completes when posted, a
receive when its send was posted; what Megatron gets by batching each send with
the next receive), and their `ActionLists` say so (`buffered_sends`), for the
validator. The simulator models sends that way for every schedule.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterable, Sequence

from megatron_async.schedules.actions import (
    MATCHING,
    Action,
    ActionLists,
    Backward,
    BackwardInput,
    Compute,
    Forward,
    ForwardBackward,
    Placement,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
    is_send,
    matches,
    tensor_key,
)


def check_sizes(num_stages: int, microbatches: int, batches: int) -> None:
    for flag, value in (("pipeline stages", num_stages), ("microbatches per batch", microbatches),
                        ("batches", batches)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"number of {flag} must be a positive integer, got {value!r}")


def check_microbatch_bound(num_stages: int, microbatches: int, batches: int, bound: int, refusal: str) -> None:
    """The sizes checked, then the schedule's least microbatches per batch: `refusal` (naming
    the flags) where there are fewer than `bound`."""
    check_sizes(num_stages, microbatches, batches)
    if microbatches < bound:
        raise ValueError(refusal)


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


def one_f_one_b_paired(forwards: Sequence, backwards: Sequence, warmup: int,
                       microbatch: Callable[[object], int] = lambda item: item) -> list[tuple[str, object]]:
    """1F1B order over `forwards` and `backwards` (the same passes' items, each list in its
    pass order) with each steady-state forward and backward as one combined step
    ("FB", (forward item, backward item)): `warmup` forwards alone, the combined steps,
    then the remaining backwards alone. A steady slot whose two passes are of the same
    microbatch (`microbatch(item)`; no warm-up) stays two passes: the backward needs the
    forward's result."""
    fs, bs = list(forwards), list(backwards)
    warmup = min(warmup, len(fs))
    order = [("F", f) for f in fs[:warmup]]
    for f, b in zip(fs[warmup:], bs):
        order += [("F", f), ("B", b)] if microbatch(f) == microbatch(b) else [("FB", (f, b))]
    order += [("B", b) for b in bs[len(fs) - warmup:]]
    return order


def _neighbour(placement: Placement, stage: int, chunk: int, step: int):
    """(stage, chunk) of the piece `step` away in model order, None past either end."""
    return placement.holder(placement.piece(stage, chunk) + step)


def _needs(action: Compute, stage: int, placement: Placement) -> list[Action]:
    """Receives that must precede `action` at `stage` (a combined step: both passes')."""
    if isinstance(action, ForwardBackward):
        return _needs(action.forward, stage, placement) + _needs(action.backward, stage, placement)
    if isinstance(action, Forward):
        prev = _neighbour(placement, stage, action.chunk, -1)
        if prev is not None and prev[0] != stage:
            return [RecvActivation(action.microbatch, prev[0], action.chunk)]
    elif isinstance(action, (Backward, BackwardInput)):
        nxt = _neighbour(placement, stage, action.chunk, +1)
        if nxt is not None and nxt[0] != stage:
            return [RecvGrad(action.microbatch, nxt[0], action.chunk)]
    return []


def _produces(action: Compute, stage: int, placement: Placement) -> list[Action]:
    """Sends that follow `action` at `stage` (a combined step: both passes', after it ends)."""
    if isinstance(action, ForwardBackward):
        return _produces(action.forward, stage, placement) + _produces(action.backward, stage, placement)
    if isinstance(action, Forward):
        nxt = _neighbour(placement, stage, action.chunk, +1)
        if nxt is not None and nxt[0] != stage:
            return [SendActivation(action.microbatch, nxt[0], action.chunk)]
    elif isinstance(action, (Backward, BackwardInput)):
        prev = _neighbour(placement, stage, action.chunk, -1)
        if prev is not None and prev[0] != stage:
            return [SendGrad(action.microbatch, prev[0], action.chunk)]
    return []


def _segments(compute: Sequence[Iterable[Compute]], placement: Placement) -> list[list[tuple[str, object]]]:
    """Per stage: compute actions, and between them the run of sends of the previous
    compute plus receives of the next one, as ("compute", action) / ("comm", [actions])."""
    segments = []
    for s, acts in enumerate(compute):
        segs, pending = [], []
        for a in acts:
            run = pending + _needs(a, s, placement)
            if run:
                segs.append(("comm", run))
            segs.append(("compute", a))
            pending = _produces(a, s, placement)
        if pending:
            segs.append(("comm", pending))
        segments.append(segs)
    return segments


def _post_buffered(s: int, run: list, out: list, posted: dict, placement: Placement) -> None:
    """Sends complete at once; a receive completes when its send heads its channel."""
    for a in list(run):
        if is_send(a):
            posted.setdefault((s, a.peer, type(a)), deque()).append(tensor_key(a, s, placement))
        else:
            channel = posted.get((a.peer, s, MATCHING[type(a)]))
            if not channel or channel[0] != tensor_key(a, s, placement):
                continue
            channel.popleft()
        out.append(a)
        run.remove(a)


def add_communication(compute: Sequence[Iterable[Compute]],
                      placement: Placement | None = None) -> list[list[Action]]:
    """Full action lists from per-stage compute orders (see module docstring); with a
    placement other than one piece per stage, an `ActionLists` that carries it."""
    if placement is None or placement.chunks_per_stage == 1:
        lists = _connect(compute, placement or Placement.linear(len(compute)), buffered=False)
        return ActionLists(lists, placement) if placement is not None else lists
    return ActionLists(_connect(compute, placement, buffered=True), placement, buffered_sends=True)


def _connect(compute: Sequence[Iterable[Compute]], placement: Placement, buffered: bool) -> list[list[Action]]:
    segments = _segments(compute, placement)
    posted: dict[tuple, deque] = {}  # buffered: (sender, receiver, send type) -> keys in posting order
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
            if buffered:
                _post_buffered(s, run, out[s], posted, placement)
            for a in [] if buffered else list(run):
                peer_run = current_run(a.peer)
                other = next((b for b in peer_run if matches(a, s, b, a.peer)), None)
                if other is not None and tensor_key(other, a.peer, placement) == tensor_key(a, s, placement):
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

"""Schedule checks for two faults the gloo test harness cannot show.

Link order. The runtime posts one isend/irecv per communication action, in list
order. Under NCCL all point-to-point operations between two ranks share one
communicator and run in posting order on its stream, both directions together, so
stage s posting [send activation k, receive gradient j] while stage s+1 posts
[send gradient j, receive activation k] hangs, where gloo (separate queues per
direction) completes. The validator's batched replay, which posts runs as the
runtime does, matches each direction on its own and accepts that list.
`check_link_order` asks for the same transfers in the same order at both ends of
every link; `check_blocking_rendezvous` runs all stages in order with each transfer
blocking until its peer reaches it, and names every stage's blocked operation.

Step ends. Between two optimizer steps control returns to Megatron's loop, whose
step-end code may wait for the whole device (`torch.cuda.synchronize` in its
timers, `empty_cache`, `--train-sync-interval`) and enter all-rank collectives
(`--gpu-sniff-test-interval`, the exit barrier). On NCCL a large send runs on the
sender's device until its receiver posts, so a send whose receive the peer posts
only after its own step end would hold every such wait on the sender while the peer
waits for the sender in the collective. `StepEnd(t)` marks where a stage's list
returns to Megatron after step t; `check_step_ends` requires every send posted
before a stage's StepEnd(t) to be received before the peer's StepEnd(t), and
`check_blocking_rendezvous(..., step_end_barrier=True)` replays the lists with an
all-rank barrier at every StepEnd.

Gradient accumulation order. Transformer Engine's fused weight-gradient
accumulation overwrites `main_grad` in the backward of the microbatch whose forward
ran with `is_first_microbatch=True` and adds in every other backward; the executor
sets that flag for microbatch k when k % m == 0. That is only right if microbatch
b*m is the first backward of batch b after OptimizerStep(b-1) and every backward of
batch b precedes OptimizerStep(b): `check_grad_accumulation_order`.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_async.schedules.actions import (
    MATCHING,
    Backward,
    BackwardWeight,
    OptimizerStep,
    Schedule,
    ScheduleError,
    is_comm,
    is_send,
    placement_of,
    tensor_key,
)


@dataclass(frozen=True)
class StepEnd:
    """Where a stage's runtime list returns to Megatron's loop after OptimizerStep(step)."""

    step: int

# The passes that write weight gradients (a BackwardInput writes none).
ACCUMULATING = (Backward, BackwardWeight)


def _counterparts(a, s: int, b, q: int, placement) -> bool:
    """True if `b` at stage `q` is the other end of the transfer `a` at stage `s`."""
    return (type(b) is MATCHING[type(a)] and a.peer == q and b.peer == s
            and tensor_key(a, s, placement) == tensor_key(b, q, placement))


def link_operations(schedule: Schedule) -> dict[tuple[int, int], tuple[list, list]]:
    """Per link (s, q) with s < q: the (action index, action) pairs stage s posts
    towards q and stage q towards s, each in list order."""
    links: dict[tuple[int, int], tuple[list, list]] = {}
    for s, acts in enumerate(schedule):
        for i, a in enumerate(acts):
            if is_comm(a):
                ends = links.setdefault((min(s, a.peer), max(s, a.peer)), ([], []))
                ends[0 if s < a.peer else 1].append((i, a))
    return links


def check_link_order(schedule: Schedule) -> None:
    """Both ends of every link post the same transfers in the same order; else
    ScheduleError naming the link, the position on it and both operations."""
    placement = placement_of(schedule)
    for (s, q), (low, high) in sorted(link_operations(schedule).items()):
        for n in range(max(len(low), len(high))):
            if n >= len(low) or n >= len(high):
                stage, (i, a) = (q, high[n]) if n >= len(low) else (s, low[n])
                other = s if stage == q else q
                raise ScheduleError(f"link {s}-{q}, operation {n}: stage {stage} posts {a!r} (action {i}), "
                                    f"stage {other} has no operation left on this link")
            (i, a), (j, b) = low[n], high[n]
            if not _counterparts(a, s, b, q, placement):
                raise ScheduleError(f"link {s}-{q}, operation {n}: stage {s} posts {a!r} (action {i}) but "
                                    f"stage {q} posts {b!r} (action {j}); both ends of a link must post the "
                                    f"same transfers in the same order (NCCL runs them in posting order)")


def check_step_ends(schedule: Schedule) -> None:
    """Every send a stage posts before its StepEnd(t) is received by the peer before
    the peer's StepEnd(t); else ScheduleError naming both ends. Needs matched links
    (`check_link_order` first)."""
    for (s, q), (low, high) in sorted(link_operations(schedule).items()):
        ends = {s: _steps_before(schedule[s]), q: _steps_before(schedule[q])}
        for (i, a), (j, b) in zip(low, high):
            (ss, si, sa), (rs, ri, ra) = ((s, i, a), (q, j, b)) if is_send(a) else ((q, j, b), (s, i, a))
            sent, received = ends[ss][si], ends[rs][ri]
            if received > sent:
                raise ScheduleError(
                    f"stage {ss} posts {sa!r} (action {si}) before its StepEnd({sent}), but stage {rs} receives "
                    f"it (action {ri}) only after its own StepEnd({received - 1}): on NCCL the send would hold "
                    f"stage {ss}'s device through Megatron's step-end code while stage {rs} waits there too")


def _steps_before(acts) -> list[int]:
    """For each action, the number of StepEnd markers before it."""
    out, n = [], 0
    for a in acts:
        out.append(n)
        n += isinstance(a, StepEnd)
    return out


def check_blocking_rendezvous(schedule: Schedule, step_end_barrier: bool = False) -> None:
    """Run every stage's list in order, each send or receive blocking until the peer
    stands at its counterpart on the same link (no buffering, one queue per link for
    both directions); ScheduleError naming every stage's blocked operation if stuck.
    `step_end_barrier`: every StepEnd(t) is an all-rank barrier (Megatron's step-end
    collectives), passed when all stages stand at it."""
    placement = placement_of(schedule)
    lists = [list(acts) for acts in schedule]
    ptr = [0] * len(lists)

    def current(s: int):
        """Stage s's next communication action (or StepEnd with the barrier), compute
        skipped (it never blocks)."""
        while ptr[s] < len(lists[s]) and not (is_comm(lists[s][ptr[s]])
                                              or (step_end_barrier and isinstance(lists[s][ptr[s]], StepEnd))):
            ptr[s] += 1
        return lists[s][ptr[s]] if ptr[s] < len(lists[s]) else None

    moved = True
    while moved:
        moved = False
        if step_end_barrier:
            at = [current(s) for s in range(len(lists))]
            if at and all(isinstance(a, StepEnd) and a == at[0] for a in at):
                for s in range(len(lists)):
                    ptr[s] += 1
                moved = True
        for s in range(len(lists)):
            while (a := current(s)) is not None and not isinstance(a, StepEnd):
                if not 0 <= a.peer < len(lists):
                    raise ScheduleError(f"stage {s}, action {ptr[s]} ({a!r}): no stage {a.peer}")
                b = current(a.peer)
                if b is None or not _counterparts(a, s, b, a.peer, placement):
                    break
                ptr[s] += 1
                ptr[a.peer] += 1
                moved = True
    blocked = [s for s in range(len(lists)) if ptr[s] < len(lists[s])]
    if blocked:
        def state(s: int) -> str:
            if ptr[s] >= len(lists[s]):
                return f"stage {s} has finished its list"
            a = lists[s][ptr[s]]
            if isinstance(a, StepEnd):
                return f"stage {s} waits at {a!r} (an all-rank barrier at the step end)"
            return f"stage {s} blocks at action {ptr[s]} ({a!r}) waiting for stage {a.peer}"
        raise ScheduleError("deadlock under in-order blocking point-to-point: "
                            + "; ".join(state(s) for s in range(len(lists))))


def check_grad_accumulation_order(schedule: Schedule, microbatches: int) -> None:
    """On every stage and model chunk, batch b's weight-gradient passes all fall between
    OptimizerStep(b-1) and OptimizerStep(b), the first of them on microbatch b*m
    (`microbatches` = m); else ScheduleError naming the stage, action and batch."""
    m = microbatches
    for s, acts in enumerate(schedule):
        # The batch whose gradients accumulate now: the next step's, or one past the last step.
        steps = [a.step for a in acts if isinstance(a, OptimizerStep)]
        current = steps[0] if steps else None
        started: set = set()  # (batch, chunk) whose first weight-gradient pass ran
        for i, a in enumerate(acts):
            if isinstance(a, OptimizerStep):
                current = a.step + 1
                continue
            if not isinstance(a, ACCUMULATING):
                continue
            b, where = a.microbatch // m, f"stage {s}, action {i} ({a!r})"
            if current is not None and b > current:
                raise ScheduleError(f"{where}: a backward of batch {b} before OptimizerStep({b - 1}); "
                                    f"its gradient would be applied by step {current}")
            if current is not None and b < current:
                raise ScheduleError(f"{where}: a backward of batch {b} after OptimizerStep({b}); its gradient "
                                    f"would be applied by step {current}, not {b}")
            if (b, a.chunk) not in started and a.microbatch != b * m:
                raise ScheduleError(f"{where}: the first backward of batch {b} is microbatch {a.microbatch}, "
                                    f"not {b * m}; the backward of {b * m} (flagged is_first_microbatch) "
                                    f"would overwrite the gradient accumulated before it")
            started.add((b, a.chunk))

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

Gradient accumulation order. Transformer Engine's fused weight-gradient
accumulation overwrites `main_grad` in the backward of the microbatch whose forward
ran with `is_first_microbatch=True` and adds in every other backward; the executor
sets that flag for microbatch k when k % m == 0. That is only right if microbatch
b*m is the first backward of batch b after OptimizerStep(b-1) and every backward of
batch b precedes OptimizerStep(b): `check_grad_accumulation_order`.
"""

from __future__ import annotations

from megatron_async.schedules.actions import (
    MATCHING,
    Backward,
    BackwardWeight,
    OptimizerStep,
    Schedule,
    is_comm,
    placement_of,
    tensor_key,
)
from megatron_async.schedules.validator import ScheduleError

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


def check_blocking_rendezvous(schedule: Schedule) -> None:
    """Run every stage's list in order, each send or receive blocking until the peer
    stands at its counterpart on the same link (no buffering, one queue per link for
    both directions); ScheduleError naming every stage's blocked operation if stuck."""
    placement = placement_of(schedule)
    lists = [list(acts) for acts in schedule]
    ptr = [0] * len(lists)

    def current(s: int):
        """Stage s's next communication action, compute skipped (it never blocks)."""
        while ptr[s] < len(lists[s]) and not is_comm(lists[s][ptr[s]]):
            ptr[s] += 1
        return lists[s][ptr[s]] if ptr[s] < len(lists[s]) else None

    moved = True
    while moved:
        moved = False
        for s in range(len(lists)):
            while (a := current(s)) is not None:
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

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

The tied link. Tied embeddings add transfers between the first and the last stage
over a group of their own (pipeline/tied_embeddings.py); `with_tied_link` adds them to
the lists where the runtime posts them (`TiedTransfer`), and the checks above keep
each group's link apart. `check_posted_receives` replays the lists with every receive
waited on where it is posted (sends never block): a receive that waits for work its
sender does later shows as a deadlock, which is what a host blocked in NCCL's lazy pair
creation, or a whole-device wait (an allocator retry anywhere) on a stage with the
receive posted, would do.

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
    SendActivation,
    ScheduleError,
    is_comm,
    is_send,
    passes,
    placement_of,
    tensor_key,
)


@dataclass(frozen=True)
class StepEnd:
    """Where a stage's runtime list returns to Megatron's loop after OptimizerStep(step)."""

    step: int

@dataclass(frozen=True)
class TiedTransfer:
    """A transfer of the tied-embedding link: `what` is "contact" (the first, at link
    creation), "grad" (batch `step`'s output-layer gradient, last to first stage) or
    "weights" (version `step`, first to last); `send` says which end this is."""

    what: str
    step: int
    peer: int
    send: bool

    def __repr__(self) -> str:
        return f"Tied{'Send' if self.send else 'Recv'}({self.what} {self.step}, peer {self.peer})"


def _transfer(a) -> bool:
    return is_comm(a) or isinstance(a, TiedTransfer)


def _sends(a) -> bool:
    return a.send if isinstance(a, TiedTransfer) else is_send(a)


def _link(s: int, a) -> tuple:
    """The link a transfer of stage s runs on: a pair of stages, and "tied" for the tied group."""
    pair = (min(s, a.peer), max(s, a.peer))
    return pair + ("tied",) if isinstance(a, TiedTransfer) else pair


def with_tied_link(schedule: Schedule, microbatches: int, grad_recv: str = "sent", contact: bool = True) -> list:
    """The runtime lists (StepEnd(t) where train_step(t) returns) with the tied link's
    transfers where the runtime posts them: the contact first on both ends; the first
    stage's receive of grad(t) once batch t's last activation send is posted
    (`grad_recv="sent"`; "first backward": before batch t's first backward, the
    negative control), its send of weights t+1 at its optimizer step (Megatron's, just
    before StepEnd(t)); the last stage's send of grad(t) at OptimizerStep(t) and its
    receive of weights t+1 at its optimizer step."""
    m, last = microbatches, len(schedule) - 1
    first_ops, last_ops = [], []
    # One gradient receive posted at a time, as the runtime's: it takes the next gradient
    # the last stage sends (a pair matches in posting order), whichever batch's hook posted it.
    posted, following = False, None  # whether one is posted; the batch of the next gradient

    def post(batch: int) -> None:
        nonlocal posted, following
        following = batch if following is None else following
        if not posted:
            first_ops.append(TiedTransfer("grad", following, last, False))
            posted = True

    for a in schedule[0]:
        if grad_recv == "first backward" and isinstance(a, Backward) and a.microbatch % m == 0:
            post(a.microbatch // m)
        if isinstance(a, OptimizerStep):  # exchange_grads posts it here if it is not yet
            post(a.step)
            posted, following = False, a.step + 1
        if isinstance(a, StepEnd):
            first_ops.append(TiedTransfer("weights", a.step + 1, last, True))
        first_ops.append(a)
        if grad_recv == "sent" and isinstance(a, SendActivation) and a.microbatch % m == m - 1:
            post(a.microbatch // m)
    for a in schedule[last]:
        if isinstance(a, StepEnd):
            last_ops.append(TiedTransfer("weights", a.step + 1, 0, False))
        last_ops.append(a)
        if isinstance(a, OptimizerStep):
            last_ops.append(TiedTransfer("grad", a.step, 0, True))
    if contact:
        first_ops = [TiedTransfer("contact", 0, last, True), TiedTransfer("contact", 0, last, False)] + first_ops
        last_ops = [TiedTransfer("contact", 0, 0, False), TiedTransfer("contact", 0, 0, True)] + last_ops
    return [first_ops] + [list(acts) for acts in schedule[1:last]] + [last_ops]


# The passes that write weight gradients (a BackwardInput writes none).
ACCUMULATING = (Backward, BackwardWeight)


def _counterparts(a, s: int, b, q: int, placement) -> bool:
    """True if `b` at stage `q` is the other end of the transfer `a` at stage `s`."""
    if isinstance(a, TiedTransfer) or isinstance(b, TiedTransfer):
        return (isinstance(a, TiedTransfer) and isinstance(b, TiedTransfer) and (a.what, a.step) == (b.what, b.step)
                and a.send != b.send and a.peer == q and b.peer == s)
    return (type(b) is MATCHING[type(a)] and a.peer == q and b.peer == s
            and tensor_key(a, s, placement) == tensor_key(b, q, placement))


def link_operations(schedule: Schedule) -> dict[tuple, tuple[list, list]]:
    """Per link (s, q) with s < q (and (s, q, "tied") for the tied group): the (action
    index, action) pairs stage s posts towards q and stage q towards s, in list order."""
    links: dict[tuple, tuple[list, list]] = {}
    for s, acts in enumerate(schedule):
        for i, a in enumerate(acts):
            if _transfer(a):
                ends = links.setdefault(_link(s, a), ([], []))
                ends[0 if s < a.peer else 1].append((i, a))
    return links


def check_link_order(schedule: Schedule) -> None:
    """Both ends of every link post the same transfers in the same order; else
    ScheduleError naming the link, the position on it and both operations."""
    placement = placement_of(schedule)
    for (s, q, *_group), (low, high) in sorted(link_operations(schedule).items()):
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
    for (s, q, *_group), (low, high) in sorted(link_operations(schedule).items()):
        ends = {s: _steps_before(schedule[s]), q: _steps_before(schedule[q])}
        for (i, a), (j, b) in zip(low, high):
            (ss, si, sa), (rs, ri, ra) = ((s, i, a), (q, j, b)) if _sends(a) else ((q, j, b), (s, i, a))
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


def _replay(schedule: Schedule, step_end_barrier: bool, advance) -> tuple[list, list]:
    """Run every stage's list in order, compute skipped (it never blocks): stage s passes its
    next transfer `a` when `advance(s, a, current, ptr)` says so (it may move the peer too).
    With `step_end_barrier` every StepEnd(t) is an all-rank barrier, passed when all stages
    stand at it. Returns the lists and where each stage stopped."""
    lists = [list(acts) for acts in schedule]
    ptr = [0] * len(lists)

    def current(s: int):
        while ptr[s] < len(lists[s]) and not (_transfer(lists[s][ptr[s]])
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
                if not advance(s, a, current, ptr):
                    break
                ptr[s] += 1
                moved = True
    return lists, ptr


def check_blocking_rendezvous(schedule: Schedule, step_end_barrier: bool = False) -> None:
    """Run every stage's list in order, each send or receive blocking until the peer
    stands at its counterpart on the same link (no buffering, one queue per link for
    both directions); ScheduleError naming every stage's blocked operation if stuck.
    `step_end_barrier`: every StepEnd(t) is an all-rank barrier (Megatron's step-end
    collectives), passed when all stages stand at it."""
    placement = placement_of(schedule)

    def meet(s, a, current, ptr) -> bool:
        b = current(a.peer)
        if b is None or not _counterparts(a, s, b, a.peer, placement):
            return False
        ptr[a.peer] += 1
        return True

    lists, ptr = _replay(schedule, step_end_barrier, meet)
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


def check_posted_receives(schedule: Schedule, step_end_barrier: bool = False) -> None:
    """Run every stage's list in order, a send never blocking (it is posted and the host
    goes on) and a receive blocking its stage until the peer has posted the send, each
    link's transfers matched in order: a stage that waits for the whole device right
    after posting any receive. ScheduleError naming every stage's blocked operation if
    stuck, or a link whose next posted send is not the receive's counterpart.
    `step_end_barrier`: every StepEnd(t) is an all-rank barrier."""
    placement = placement_of(schedule)
    queued: dict = {}  # (link, direction) -> sends posted and not yet received, in order

    def post_or_receive(s, a, _current, _ptr) -> bool:
        if _sends(a):
            queued.setdefault((_link(s, a), s), []).append(a)
            return True
        waiting = queued.get((_link(s, a), a.peer), [])
        if not waiting:
            return False
        if not _counterparts(a, s, waiting[0], a.peer, placement):
            raise ScheduleError(f"stage {s} receives {a!r} but the next send stage {a.peer} posted on that link "
                                f"is {waiting[0]!r}: a link matches in posting order")
        waiting.pop(0)
        return True

    lists, ptr = _replay(schedule, step_end_barrier, post_or_receive)
    blocked = [s for s in range(len(lists)) if ptr[s] < len(lists[s])]
    if blocked:
        raise ScheduleError("deadlock with every receive waited on where it is posted: " + "; ".join(
            f"stage {s} blocks at action {ptr[s]} ({lists[s][ptr[s]]!r})" for s in blocked))


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
        # a combined step's backward accumulates like a Backward of its own
        flat = [(i, x) for i, action in enumerate(acts)
                for x in (passes(action) if not isinstance(action, OptimizerStep) else (action,))]
        for i, a in flat:
            if isinstance(a, OptimizerStep):
                current = a.step + 1
                continue
            if not isinstance(a, ACCUMULATING):
                continue
            b, where = a.microbatch // m, f"stage {s}, action {i} ({acts[i]!r})"
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

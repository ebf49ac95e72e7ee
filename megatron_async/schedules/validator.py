"""Schedule validator: proves an action-list schedule is runnable and measures its cost.

`validate(schedule)` checks, per stage, that every backward follows its own forward
and the arrival of its output gradient, that forward and backward of a microbatch
use the same weight version and that version exists already, that every tensor
produced is sent and every one consumed was received, and that all gradients get
applied. It then replays all stages together with blocking rendezvous p2p (a send
and its receive complete together, matched in order per direction) and fails on a
stuck state, so the order is deadlock-free for an executor that blocks on every
send and receive (and hence for one that posts runs as batches; see `actions`).

A combined step (`ForwardBackward`) is checked as its two passes, the backward first:
its own forward must have ended before the step, and both passes' activations count
as in flight during it. With `weight_versions` the validator also refuses a stage
that needs more versions at once than the runtime keeps.

Memory and staleness, per stage (definitions used in the report):
- weight versions alive after an action: the newest version (the stage's current
  weights) plus every older version some not yet finished forward or backward of
  this stage will still use; `max_weight_versions` is the maximum over the list.
- activations in flight: microbatches forwarded whose backward has not run yet.
- delay of a gradient: a step t applies the gradients accumulated since the
  previous step to version t; a gradient computed at version v has delay t - v.
  `delay_per_stage` is the largest delay (the steady state: delays only grow during
  the warm-up, e.g. 2bw's batch 0 has delay 0 and every later batch delay 1),
  `delay_sets` all delays seen.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_async.schedules.actions import (  # ScheduleError: raised here, defined with the actions
    MATCHING,
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    ForwardBackward,
    OptimizerStep,
    Placement,
    RecvActivation,
    RecvGrad,
    Schedule,
    ScheduleError,
    SendActivation,
    SendGrad,
    is_comm,
    passes,
    placement_of,
    tensor_key,
)


@dataclass(frozen=True)
class ScheduleReport:
    num_stages: int
    num_microbatches: int
    num_steps: int
    max_weight_versions: list[int]
    max_inflight_microbatches: list[int]
    delay_per_stage: list[int]
    delay_sets: list[list[int]] = field(default_factory=list)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class _StageStats:
    forwards: set
    steps: int
    max_versions: int
    max_inflight: int
    delays: set
    versions_at: tuple  # (index, action) where the stage first holds max_versions


def _fail(stage: int, index, action, what: str):
    where = f"action {index} ({action!r})" if action is not None else "end of list"
    raise ScheduleError(f"stage {stage}, {where}: {what}")


def _last_use(actions) -> dict[int, int]:
    last = {}
    for i, a in enumerate(actions):
        for pass_ in passes(a):
            last[pass_.version] = i
    return last


def _check_peer(s, i, a, placement: Placement):
    downstream = isinstance(a, (SendActivation, RecvGrad))
    if (s, a.chunk) not in placement.order:
        _fail(s, i, a, f"chunk {a.chunk} is not held by stage {s} in the placement")
    other = placement.holder(placement.piece(s, a.chunk) + (1 if downstream else -1))
    if other is None or other[0] != a.peer or a.peer == s:
        flow = "to the next piece of the model" if downstream else "to the previous piece"
        expected = "no stage (the model ends there)" if other is None else f"stage {other[0]}"
        _fail(s, i, a, f"peer {a.peer} is not stage {s}'s neighbour in that direction "
                       f"({type(a).__name__} talks {flow}: {expected})")


class _Stage:
    """What one stage has done so far, keyed by (microbatch, chunk)."""

    def __init__(self, s: int, placement: Placement):
        self.s, self.placement = s, placement
        self.fwd, self.grad_in, self.grad_w = {}, set(), set()
        self.recv_act, self.recv_grad, self.sent_act, self.sent_grad = set(), set(), set(), set()

    def local(self, chunk: int, step: int):
        """The chunk of this stage `step` pieces away from `chunk`: ("local", c), ("remote", stage) or None."""
        other = self.placement.holder(self.placement.piece(self.s, chunk) + step)
        if other is None:
            return None
        return ("local", other[1]) if other[0] == self.s else ("remote", other[0])


def _check_forward(st: _Stage, i, a, newest):
    key = (a.microbatch, a.chunk)
    if key in st.fwd:
        _fail(st.s, i, a, f"microbatch {a.microbatch} is forwarded twice")
    prev = st.local(a.chunk, -1)
    if prev and prev[0] == "remote" and key not in st.recv_act:
        _fail(st.s, i, a, f"Forward of microbatch {a.microbatch} before its input arrived: "
                          f"{RecvActivation(a.microbatch, prev[1], a.chunk)!r} is missing before it")
    if prev and prev[0] == "local" and (a.microbatch, prev[1]) not in st.fwd:
        _fail(st.s, i, a, f"Forward of microbatch {a.microbatch} before the forward of its input "
                          f"on chunk {prev[1]} of this stage")
    if not 0 <= a.version <= newest:
        _fail(st.s, i, a, f"uses version {a.version}, but only versions 0..{newest} exist here "
                          f"(OptimizerStep({a.version - 1}) has not run on this stage yet)")
    st.fwd[key] = a.version


def _check_backward(st: _Stage, i, a):
    """A Backward or BackwardInput: the input gradient of one microbatch."""
    key, k = (a.microbatch, a.chunk), a.microbatch
    if key not in st.fwd:
        _fail(st.s, i, a, f"Backward of microbatch {k} before its Forward")
    if key in st.grad_in:
        _fail(st.s, i, a, f"microbatch {k} is backpropagated twice")
    if a.version != st.fwd[key]:
        _fail(st.s, i, a, f"version mismatch: Backward of microbatch {k} uses version {a.version} "
                          f"but its Forward used version {st.fwd[key]}")
    nxt = st.local(a.chunk, +1)
    if nxt and nxt[0] == "remote" and key not in st.recv_grad:
        _fail(st.s, i, a, f"Backward of microbatch {k} before its output gradient arrived: "
                          f"{RecvGrad(k, nxt[1], a.chunk)!r} is missing before it")
    if nxt and nxt[0] == "local" and (k, nxt[1]) not in st.grad_in:
        _fail(st.s, i, a, f"Backward of microbatch {k} before the backward of chunk {nxt[1]} of this stage")
    st.grad_in.add(key)


def _check_pair(st: _Stage, i, a: ForwardBackward):
    if not isinstance(a.forward, Forward) or not isinstance(a.backward, Backward):
        _fail(st.s, i, a, "a combined step holds one Forward and one Backward")
    if a.forward.microbatch == a.backward.microbatch:
        _fail(st.s, i, a, f"a combined step pairs two different microbatches: the backward of microbatch "
                          f"{a.backward.microbatch} needs its forward to have ended before the step")


def _check_weight(st: _Stage, i, a):
    key = (a.microbatch, a.chunk)
    if key not in st.grad_in:
        _fail(st.s, i, a, f"BackwardWeight of microbatch {a.microbatch} before its BackwardInput")
    if key in st.grad_w:
        _fail(st.s, i, a, f"weight gradient of microbatch {a.microbatch} is computed twice")
    if a.version != st.fwd[key]:
        _fail(st.s, i, a, f"version mismatch: BackwardWeight of microbatch {a.microbatch} uses version "
                          f"{a.version} but its Forward used version {st.fwd[key]}")
    st.grad_w.add(key)


def _check_comm(st: _Stage, i, a):
    _check_peer(st.s, i, a, st.placement)
    key, k = (a.microbatch, a.chunk), a.microbatch
    if isinstance(a, SendActivation):
        if key not in st.fwd:
            _fail(st.s, i, a, f"sends the activation of microbatch {k} before its Forward")
        if key in st.sent_act:
            _fail(st.s, i, a, f"activation of microbatch {k} is sent twice")
        st.sent_act.add(key)
    elif isinstance(a, SendGrad):
        if key not in st.grad_in:
            _fail(st.s, i, a, f"sends the gradient of microbatch {k} before its Backward")
        if key in st.sent_grad:
            _fail(st.s, i, a, f"gradient of microbatch {k} is sent twice")
        st.sent_grad.add(key)
    elif isinstance(a, RecvActivation):
        if key in st.recv_act:
            _fail(st.s, i, a, f"activation of microbatch {k} is received twice")
        st.recv_act.add(key)
    elif isinstance(a, RecvGrad):
        if key not in st.sent_act:
            _fail(st.s, i, a, f"receives the gradient of microbatch {k} before sending its activation")
        if key in st.recv_grad:
            _fail(st.s, i, a, f"gradient of microbatch {k} is received twice")
        st.recv_grad.add(key)


def _check_stage(s: int, actions, placement: Placement) -> _StageStats:
    st = _Stage(s, placement)
    newest, inflight, max_inflight = 0, 0, 0
    pending_grads, delays = [], set()
    last_use = _last_use(actions)
    held, max_versions, versions_at = set(), 1, (None, None)  # versions older than `newest` still needed
    for i, a in enumerate(actions):
        if isinstance(a, Forward):
            _check_forward(st, i, a, newest)
            inflight += 1
            max_inflight = max(max_inflight, inflight)
        elif isinstance(a, (Backward, BackwardInput)):
            _check_backward(st, i, a)
            inflight -= 1
            if isinstance(a, Backward):
                st.grad_w.add((a.microbatch, a.chunk))
                pending_grads.append(a.version)
        elif isinstance(a, ForwardBackward):
            # the backward's own forward ran before the step: checked before the step's forward counts
            _check_pair(st, i, a)
            _check_backward(st, i, a.backward)
            _check_forward(st, i, a.forward, newest)
            max_inflight = max(max_inflight, inflight + 1)  # both passes' activations live during the step
            st.grad_w.add((a.backward.microbatch, a.backward.chunk))
            pending_grads.append(a.backward.version)
        elif isinstance(a, BackwardWeight):
            _check_weight(st, i, a)
            pending_grads.append(a.version)
        elif isinstance(a, OptimizerStep):
            if a.step != newest:
                _fail(s, i, a, f"expected OptimizerStep({newest}): steps run in order, step t produces version t+1")
            if st.grad_in - st.grad_w:
                missing = sorted(k for k, _ in st.grad_in - st.grad_w)
                _fail(s, i, a, f"optimizer step before the weight gradients of microbatches {missing[:8]}")
            if not pending_grads:
                _fail(s, i, a, "optimizer step with no backward since the previous step")
            delays |= {a.step - v for v in pending_grads}
            pending_grads = []
            if last_use.get(newest, -1) > i:
                held.add(newest)
            newest += 1
        elif is_comm(a):
            _check_comm(st, i, a)
        else:
            _fail(s, i, a, f"unknown action type {type(a).__name__}")
        held = {v for v in held if last_use[v] > i}
        if 1 + len(held) > max_versions:
            max_versions, versions_at = 1 + len(held), (i, a)
    _check_end(st, pending_grads)
    forwards = {k for k, _ in st.fwd}
    return _StageStats(forwards, newest, max_versions, max_inflight, delays, versions_at)


def _check_end(st: _Stage, pending_grads) -> None:
    s = st.s
    for key in sorted(st.fwd.keys() - st.grad_in):
        _fail(s, None, None, f"microbatch {key[0]} is forwarded but never backpropagated")
    for key in sorted(st.grad_in - st.grad_w):
        _fail(s, None, None, f"the weight gradient of microbatch {key[0]} is never computed")
    for done, sent, step, what in ((st.fwd.keys(), st.sent_act, +1, "activations"),
                                   (st.grad_in, st.sent_grad, -1, "gradients")):
        unsent = {}
        for k, c in done - sent:
            other = st.local(c, step)
            if other and other[0] == "remote":
                unsent.setdefault(other[1], []).append(k)
        for peer, ks in sorted(unsent.items()):
            _fail(s, None, None, f"{what} of microbatches {sorted(ks)} are never sent to stage {peer}")
    if st.recv_act - st.fwd.keys():
        _fail(s, None, None, f"activations of microbatches {sorted(k for k, _ in st.recv_act - st.fwd.keys())} "
                             "are received, never used")
    if pending_grads:
        _fail(s, None, None, "gradients of the last backwards are never applied (no OptimizerStep after them)")


def _check_across(stats: list[_StageStats]) -> None:
    for s, st in enumerate(stats[1:], start=1):
        if st.forwards != stats[0].forwards:
            diff = sorted(st.forwards ^ stats[0].forwards)
            _fail(s, None, None, f"runs a different set of microbatches than stage 0 (differs in {diff[:8]})")
        if st.steps != stats[0].steps:
            _fail(s, None, None, f"runs {st.steps} optimizer steps, stage 0 runs {stats[0].steps}")


def _window(actions, start: int, mode: str) -> list[int]:
    """Indices of the communication actions a stage has posted and waits on."""
    idx, i = [], start
    while i < len(actions) and is_comm(actions[i]):
        idx.append(i)
        i += 1
        if mode == "blocking":
            break
    return idx


def _first_open(actions, window, done, kind, peer):
    for i in window:
        if i not in done and type(actions[i]) is kind and actions[i].peer == peer:
            return i
    return None


def check_deadlock_free(schedule: Schedule, mode: str = "blocking") -> None:
    """Replay all stages together; raise ScheduleError if they get stuck.

    mode "blocking": one send/recv at a time, each completes only with its match.
    mode "batched": a run of adjacent send/recv actions is posted at once and waited
    on together. mode "buffered": a send completes when posted, a receive once its
    send was posted (the lists of multi-chunk schedules, see `gen_common`).
    Messages match in order per (sender, receiver) direction.
    """
    if mode == "buffered":
        return _check_buffered(schedule)
    if mode not in ("blocking", "batched"):
        raise ValueError(f"mode must be 'blocking', 'batched' or 'buffered', got {mode!r}")
    placement = placement_of(schedule)
    lists = [list(acts) for acts in schedule]
    ptr = [0] * len(lists)
    done = [set() for _ in lists]
    progress = True
    while progress:
        progress = False
        for s, acts in enumerate(lists):
            while ptr[s] < len(acts) and not is_comm(acts[ptr[s]]):
                ptr[s] += 1
                progress = True
            win = _window(acts, ptr[s], mode)
            for i in win:
                a = acts[i]
                if i in done[s] or _first_open(acts, win, done[s], type(a), a.peer) != i:
                    continue
                q = a.peer
                j = _first_open(lists[q], _window(lists[q], ptr[q], mode), done[q], MATCHING[type(a)], s)
                if j is None:
                    continue
                b = lists[q][j]
                if tensor_key(b, q, placement) != tensor_key(a, s, placement):
                    _fail(s, i, a, f"is matched by stage {q}, action {j} ({b!r}): the two stages "
                                   f"exchange microbatches in a different order")
                done[s].add(i)
                done[q].add(j)
                progress = True
            if win and all(i in done[s] for i in win):
                ptr[s] = win[-1] + 1
                done[s].clear()
                progress = True
    stuck = [s for s, acts in enumerate(lists) if ptr[s] < len(acts)]
    if stuck:
        def state(q):
            if ptr[q] >= len(lists[q]):
                return f"stage {q} has finished its list"
            return f"stage {q} waits at action {ptr[q]} ({lists[q][ptr[q]]!r})"
        s = stuck[0]
        i = next(i for i in _window(lists[s], ptr[s], mode) if i not in done[s])
        a = lists[s][i]
        others = "; ".join(state(q) for q in dict.fromkeys([a.peer] + stuck[1:]) if q != s)
        _fail(s, i, a, f"deadlock: never matched by stage {a.peer} ({others})")


def _check_buffered(schedule: Schedule) -> None:
    placement = placement_of(schedule)
    lists = [list(acts) for acts in schedule]
    ptr = [0] * len(lists)
    posted: dict[tuple, list] = {}  # (sender, receiver, send type) -> keys not yet received
    progress = True
    while progress:
        progress = False
        for s, acts in enumerate(lists):
            while ptr[s] < len(acts):
                a = acts[ptr[s]]
                if is_comm(a) and type(a) in (SendActivation, SendGrad):
                    posted.setdefault((s, a.peer, type(a)), []).append(tensor_key(a, s, placement))
                elif is_comm(a):
                    channel = posted.get((a.peer, s, MATCHING[type(a)]))
                    if not channel:
                        break
                    if channel[0] != tensor_key(a, s, placement):
                        _fail(s, ptr[s], a, f"receives {channel[0]} first from stage {a.peer}: the two stages "
                                            "exchange microbatches in a different order")
                    channel.pop(0)
                ptr[s] += 1
                progress = True
    for s, acts in enumerate(lists):
        if ptr[s] < len(acts):
            _fail(s, ptr[s], acts[ptr[s]], f"deadlock: stage {acts[ptr[s]].peer} never sends it")


def validate(schedule: Schedule, mode: str | None = None, weight_versions: int | None = None) -> ScheduleReport:
    """Check `schedule` (one action list per stage); return its memory/delay report.
    With `weight_versions`, also refuse a stage that needs more weight versions at once
    than that (what the schedule's runtime keeps: two under 2bw)."""
    if not schedule:
        raise ScheduleError("a schedule needs at least one stage")
    placement = placement_of(schedule)
    if placement.num_stages != len(schedule):
        raise ScheduleError(f"the placement has {placement.num_stages} stages, the schedule {len(schedule)} lists")
    stats = [_check_stage(s, acts, placement) for s, acts in enumerate(schedule)]
    _check_across(stats)
    for s, st in enumerate(stats):
        if weight_versions is not None and st.max_versions > weight_versions:
            _fail(s, *st.versions_at, f"needs {st.max_versions} weight versions at once (its current weights "
                                      f"and the older ones unfinished passes use), the runtime keeps {weight_versions}")
    if mode is None:
        mode = "buffered" if getattr(schedule, "buffered_sends", False) else "blocking"
    check_deadlock_free(schedule, mode)
    if mode == "blocking":  # one stream per link, both directions (NCCL): the same order at both ends
        from megatron_async.schedules.link_order import check_link_order

        check_link_order(schedule)
    return ScheduleReport(
        num_stages=len(schedule),
        num_microbatches=len(stats[0].forwards),
        num_steps=stats[0].steps,
        max_weight_versions=[st.max_versions for st in stats],
        max_inflight_microbatches=[st.max_inflight for st in stats],
        delay_per_stage=[max(st.delays, default=0) for st in stats],
        delay_sets=[sorted(st.delays) for st in stats],
    )

"""Schedule validator: proves an action-list schedule is runnable and measures its cost.

`validate(schedule)` checks, per stage, that every backward follows its own forward
and the arrival of its output gradient, that forward and backward of a microbatch
use the same weight version and that version exists already, that every tensor
produced is sent and every one consumed was received, and that all gradients get
applied. It then replays all stages together with blocking rendezvous p2p (a send
and its receive complete together, matched in order per direction) and fails on a
stuck state, so the order is deadlock-free for an executor that blocks on every
send and receive (and hence for one that posts runs as batches; see `actions`).

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

from megatron_async.schedules.actions import (
    MATCHING,
    Backward,
    Forward,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    Schedule,
    SendActivation,
    SendGrad,
    is_comm,
)


class ScheduleError(ValueError):
    """A schedule that is wrong; the message names the stage, action index and fault."""


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


def _fail(stage: int, index, action, what: str):
    where = f"action {index} ({action!r})" if action is not None else "end of list"
    raise ScheduleError(f"stage {stage}, {where}: {what}")


def _last_use(actions) -> dict[int, int]:
    last = {}
    for i, a in enumerate(actions):
        if isinstance(a, (Forward, Backward)):
            last[a.version] = i
    return last


def _check_peer(s, i, a, last):
    expected = s + 1 if isinstance(a, (SendActivation, RecvGrad)) else s - 1
    if a.peer != expected or not 0 <= expected <= last:
        flow = "to the next stage" if isinstance(a, (SendActivation, RecvGrad)) else "to the previous stage"
        _fail(s, i, a, f"peer {a.peer} is not stage {s}'s neighbour in that direction "
                       f"({type(a).__name__} talks {flow}, stages 0..{last})")


def _check_stage(s: int, actions, last: int) -> _StageStats:
    fwd, bwd = {}, set()
    recv_act, recv_grad, sent_act, sent_grad = set(), set(), set(), set()
    newest, inflight, max_inflight = 0, 0, 0
    pending_grads, delays = [], set()
    last_use = _last_use(actions)
    held, max_versions = set(), 1  # versions older than `newest` still needed
    for i, a in enumerate(actions):
        k = getattr(a, "microbatch", None)
        if isinstance(a, Forward):
            if k in fwd:
                _fail(s, i, a, f"microbatch {k} is forwarded twice")
            if s > 0 and k not in recv_act:
                _fail(s, i, a, f"Forward of microbatch {k} before its input arrived: "
                               f"RecvActivation(microbatch={k}, peer={s - 1}) is missing before it")
            if not 0 <= a.version <= newest:
                _fail(s, i, a, f"uses version {a.version}, but only versions 0..{newest} exist here "
                               f"(OptimizerStep({a.version - 1}) has not run on this stage yet)")
            fwd[k] = a.version
            inflight += 1
            max_inflight = max(max_inflight, inflight)
        elif isinstance(a, Backward):
            if k not in fwd:
                _fail(s, i, a, f"Backward of microbatch {k} before its Forward")
            if k in bwd:
                _fail(s, i, a, f"microbatch {k} is backpropagated twice")
            if a.version != fwd[k]:
                _fail(s, i, a, f"version mismatch: Backward of microbatch {k} uses version {a.version} "
                               f"but its Forward used version {fwd[k]}")
            if s < last and k not in recv_grad:
                _fail(s, i, a, f"Backward of microbatch {k} before its output gradient arrived: "
                               f"RecvGrad(microbatch={k}, peer={s + 1}) is missing before it")
            bwd.add(k)
            inflight -= 1
            pending_grads.append(a.version)
        elif isinstance(a, OptimizerStep):
            if a.step != newest:
                _fail(s, i, a, f"expected OptimizerStep({newest}): steps run in order, step t produces version t+1")
            if not pending_grads:
                _fail(s, i, a, "optimizer step with no backward since the previous step")
            delays |= {a.step - v for v in pending_grads}
            pending_grads = []
            if last_use.get(newest, -1) > i:
                held.add(newest)
            newest += 1
        elif is_comm(a):
            _check_peer(s, i, a, last)
            if isinstance(a, SendActivation):
                if k not in fwd:
                    _fail(s, i, a, f"sends the activation of microbatch {k} before its Forward")
                if k in sent_act:
                    _fail(s, i, a, f"activation of microbatch {k} is sent twice")
                sent_act.add(k)
            elif isinstance(a, SendGrad):
                if k not in bwd:
                    _fail(s, i, a, f"sends the gradient of microbatch {k} before its Backward")
                if k in sent_grad:
                    _fail(s, i, a, f"gradient of microbatch {k} is sent twice")
                sent_grad.add(k)
            elif isinstance(a, RecvActivation):
                if k in recv_act:
                    _fail(s, i, a, f"activation of microbatch {k} is received twice")
                recv_act.add(k)
            elif isinstance(a, RecvGrad):
                if k not in sent_act:
                    _fail(s, i, a, f"receives the gradient of microbatch {k} before sending its activation")
                if k in recv_grad:
                    _fail(s, i, a, f"gradient of microbatch {k} is received twice")
                recv_grad.add(k)
        else:
            _fail(s, i, a, f"unknown action type {type(a).__name__}")
        held = {v for v in held if last_use[v] > i}
        max_versions = max(max_versions, 1 + len(held))

    for k in sorted(fwd.keys() - bwd):
        _fail(s, None, None, f"microbatch {k} is forwarded but never backpropagated")
    if s < last and fwd.keys() - sent_act:
        _fail(s, None, None, f"activations of microbatches {sorted(fwd.keys() - sent_act)} are never "
                             f"sent to stage {s + 1}")
    if s > 0 and bwd - sent_grad:
        _fail(s, None, None, f"gradients of microbatches {sorted(bwd - sent_grad)} are never sent to stage {s - 1}")
    if recv_act - fwd.keys():
        _fail(s, None, None, f"activations of microbatches {sorted(recv_act - fwd.keys())} are received, never used")
    if pending_grads:
        _fail(s, None, None, "gradients of the last backwards are never applied (no OptimizerStep after them)")
    return _StageStats(set(fwd), newest, max_versions, max_inflight, delays)


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
    on together. Messages match in order per (sender, receiver) direction.
    """
    if mode not in ("blocking", "batched"):
        raise ValueError(f"mode must be 'blocking' or 'batched', got {mode!r}")
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
                if b.microbatch != a.microbatch:
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


def validate(schedule: Schedule, mode: str = "blocking") -> ScheduleReport:
    """Check `schedule` (one action list per stage); return its memory/delay report."""
    if not schedule:
        raise ScheduleError("a schedule needs at least one stage")
    last = len(schedule) - 1
    stats = [_check_stage(s, acts, last) for s, acts in enumerate(schedule)]
    _check_across(stats)
    check_deadlock_free(schedule, mode)
    return ScheduleReport(
        num_stages=len(schedule),
        num_microbatches=len(stats[0].forwards),
        num_steps=stats[0].steps,
        max_weight_versions=[st.max_versions for st in stats],
        max_inflight_microbatches=[st.max_inflight for st in stats],
        delay_per_stage=[max(st.delays, default=0) for st in stats],
        delay_sets=[sorted(st.delays) for st in stats],
    )

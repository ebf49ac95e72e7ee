"""Event-driven timing simulator for action-list schedules.

It runs the lists the way the executor contract in `actions` allows: compute
actions take their cost on their stage, a run of adjacent send/recv actions is
posted at once, a send does not block its sender (the data leaves when posted) and
a receive completes `p2p` time units after its matching send was posted. Costs may
be scalars or one value per stage (imbalanced stages).

With `sync_at_step=True`, optimizer step t is a blocking collective over all stages,
like a global gradient-norm all-reduce: each stage's step t starts only once every
stage has reached its step t, plus `sync_cost`, then takes `opt`.

Zero-bubble schedules split backwards: `bwd_input` and `bwd_weight` cost the two
halves (by default half of `bwd` each; their sum above `bwd` is the split's own
overhead). On stages holding several pieces of the model (interleaved, ZB-V) every
cost is per pass of one piece: the caller divides a stage's cost by its chunks.

A combined step (`ForwardBackward`, a forward beside another microbatch's backward)
costs `pair` on its stage, by default `fwd + bwd` (nothing hidden); the caller prices
what the overlap hides. Both its sends leave when the whole step ends.

Busy time is forward + backward + combined step + optimizer compute; everything else in
[0, makespan] (waiting for data, for the collective, `sync_cost`) is bubble.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

from megatron_async.schedules.actions import (
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    ForwardBackward,
    OptimizerStep,
    Schedule,
    is_comm,
    is_send,
    passes,
    placement_of,
    tensor_key,
)
from megatron_async.schedules.validator import ScheduleReport, validate

Cost = Union[float, Sequence[float]]


@dataclass(frozen=True)
class SimEvent:
    stage: int
    # "forward" | "backward" | "backward_input" | "backward_weight" | "forward_backward" | "optimizer" | "sync"
    kind: str
    start: float
    end: float
    microbatch: Optional[int] = None
    version: Optional[int] = None
    step: Optional[int] = None
    chunk: int = 0
    paired: Optional[tuple] = None  # a combined step's backward: (microbatch, version, chunk)


@dataclass
class SimResult:
    makespan: float
    bubble_fraction: float  # idle time of all stages / (stages * makespan)
    bubble_per_stage: list[float]
    busy_per_stage: list[float]
    throughput: float  # microbatches per time unit over the middle optimizer steps
    step_end_times: list[float]  # when the last stage finished optimizer step t
    report: ScheduleReport
    events: list[SimEvent] = field(default_factory=list)
    action_ends: list[list[float]] = field(default_factory=list)  # [stage][index]: when each action ended

    @property
    def num_stages(self) -> int:
        return self.report.num_stages

    def summary(self) -> dict:
        """The numbers, JSON-ready (no event list)."""
        r = self.report
        return {
            "makespan": self.makespan,
            "bubble_fraction": self.bubble_fraction,
            "bubble_per_stage": self.bubble_per_stage,
            "throughput": self.throughput,
            "max_weight_versions": r.max_weight_versions,
            "max_inflight_microbatches": r.max_inflight_microbatches,
            "delay_per_stage": r.delay_per_stage,
            "num_stages": r.num_stages,
            "num_microbatches": r.num_microbatches,
            "num_steps": r.num_steps,
        }


def _per_stage(value: Cost, p: int, name: str) -> list[float]:
    if isinstance(value, (int, float)):
        values = [float(value)] * p
    else:
        values = [float(v) for v in value]
        if len(values) != p:
            raise ValueError(f"{name} needs one value or one per stage ({p}), got {len(values)}")
    if any(v < 0 for v in values):
        raise ValueError(f"{name} costs must be >= 0, got {values}")
    return values


def _throughput(schedule: Schedule, step_ends: list[float], makespan: float, total: int) -> float:
    """Microbatches per time unit between the ends of step 0 and step T-2 (the middle
    batches: no warm-up, no cool-down); the whole run when there are fewer than 3 steps."""
    if len(step_ends) < 3:
        return total / makespan if makespan > 0 else float("inf")
    per_step, count = [], 0
    for a in schedule[0]:
        if any(isinstance(x, (Backward, BackwardWeight)) and x.chunk == 0 for x in passes(a)):
            count += 1
        elif isinstance(a, OptimizerStep):
            per_step.append(count)
            count = 0
    span = step_ends[-2] - step_ends[0]
    return sum(per_step[1:-1]) / span if span > 0 else float("inf")


def simulate(schedule: Schedule, fwd: Cost = 1.0, bwd: Cost = 2.0, opt: Cost = 0.0, p2p: float = 0.0,
             sync_at_step: bool = False, sync_cost: float = 0.0, bwd_input: Optional[Cost] = None,
             bwd_weight: Optional[Cost] = None, pair: Optional[Cost] = None,
             weight_versions: Optional[int] = None) -> SimResult:
    """Time `schedule` (validated first, with `weight_versions` if given) under the given
    costs; see module docstring."""
    report = validate(schedule, weight_versions=weight_versions)
    p, placement = len(schedule), placement_of(schedule)
    f, b, o = _per_stage(fwd, p, "fwd"), _per_stage(bwd, p, "bwd"), _per_stage(opt, p, "opt")
    fb = [x + y for x, y in zip(f, b)] if pair is None else _per_stage(pair, p, "pair")
    bi = [x / 2 for x in b] if bwd_input is None else _per_stage(bwd_input, p, "bwd_input")
    bw = [x / 2 for x in b] if bwd_weight is None else _per_stage(bwd_weight, p, "bwd_weight")
    pass_cost = {Forward: ("forward", f), Backward: ("backward", b), BackwardInput: ("backward_input", bi),
                 BackwardWeight: ("backward_weight", bw)}
    if p2p < 0 or sync_cost < 0:
        raise ValueError("p2p and sync_cost must be >= 0")
    lists = [list(acts) for acts in schedule]
    ptr, clock, posted = [0] * p, [0.0] * p, [False] * p
    sent: dict[tuple, float] = {}
    arrivals: dict[int, dict[int, float]] = {}
    events: list[SimEvent] = []
    busy = [0.0] * p
    action_ends: list[list[float]] = [[] for _ in range(p)]

    def run(s: int) -> bool:
        acts, moved = lists[s], False
        while ptr[s] < len(acts):
            a = acts[ptr[s]]
            if type(a) in pass_cost:
                kind, costs = pass_cost[type(a)]
                dur = costs[s]
                events.append(SimEvent(s, kind, clock[s], clock[s] + dur, a.microbatch, a.version, chunk=a.chunk))
            elif isinstance(a, ForwardBackward):
                dur, back = fb[s], a.backward
                events.append(SimEvent(s, "forward_backward", clock[s], clock[s] + dur, a.forward.microbatch,
                                       a.forward.version, chunk=a.forward.chunk,
                                       paired=(back.microbatch, back.version, back.chunk)))
            elif isinstance(a, OptimizerStep):
                start = clock[s]
                if sync_at_step:
                    arrived = arrivals.setdefault(a.step, {})
                    arrived.setdefault(s, clock[s])
                    if len(arrived) < p:
                        return moved
                    start = max(arrived.values()) + sync_cost
                    events.append(SimEvent(s, "sync", clock[s], start, step=a.step))
                clock[s], dur = start, o[s]
                events.append(SimEvent(s, "optimizer", start, start + dur, step=a.step))
            else:
                end = ptr[s]
                while end < len(acts) and is_comm(acts[end]):
                    end += 1
                batch = acts[ptr[s]:end]
                if not posted[s]:
                    for c in filter(is_send, batch):
                        sent[tensor_key(c, s, placement)] = clock[s]
                    posted[s] = moved = True
                keys = [tensor_key(c, s, placement) for c in batch if not is_send(c)]
                if any(k not in sent for k in keys):
                    return moved
                clock[s] = max([clock[s]] + [sent[k] + p2p for k in keys])
                action_ends[s].extend([clock[s]] * (end - ptr[s]))
                ptr[s], posted[s] = end, False
                moved = True
                continue
            clock[s] += dur
            busy[s] += dur
            action_ends[s].append(clock[s])
            ptr[s] += 1
            moved = True
        return moved

    while any(ptr[s] < len(lists[s]) for s in range(p)):
        if not any([run(s) for s in range(p)]):
            raise RuntimeError("simulation stuck on a validated schedule (simulator bug)")

    makespan = max(clock)
    idle = [makespan - busy[s] for s in range(p)]
    bubble = [i / makespan if makespan > 0 else 0.0 for i in idle]
    step_ends = [0.0] * report.num_steps
    for e in events:
        if e.kind == "optimizer":
            step_ends[e.step] = max(step_ends[e.step], e.end)
    events.sort(key=lambda e: (e.stage, e.start, e.end))
    return SimResult(
        makespan=makespan,
        bubble_fraction=sum(idle) / (p * makespan) if makespan > 0 else 0.0,
        bubble_per_stage=bubble,
        busy_per_stage=busy,
        throughput=_throughput(schedule, step_ends, makespan, report.num_microbatches),
        step_end_times=step_ends,
        report=report,
        events=events,
        action_ends=action_ends,
    )


def to_chrome_trace(result: SimResult, time_unit_us: float = 1000.0) -> dict:
    """Chrome/Perfetto "traceEvents" JSON: one thread (tid) per stage; one simulated
    time unit is `time_unit_us` microseconds (default: shown as milliseconds)."""
    trace = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": s, "args": {"name": f"stage {s}"}}
             for s in range(result.num_stages)]
    for e in result.events:
        if e.paired is not None:
            name = f"F{e.microbatch} v{e.version} + B{e.paired[0]} v{e.paired[1]}"
            args = {"microbatch": e.microbatch, "version": e.version, "chunk": e.chunk,
                    "backward": dict(zip(("microbatch", "version", "chunk"), e.paired))}
        elif e.microbatch is not None:
            letter = {"forward": "F", "backward": "B", "backward_input": "I", "backward_weight": "W"}[e.kind]
            name = f"{letter}{e.microbatch} v{e.version}" + (f" c{e.chunk}" if e.chunk else "")
            args = {"microbatch": e.microbatch, "version": e.version, "chunk": e.chunk}
        else:
            name = f"{'step' if e.kind == 'optimizer' else 'sync'} {e.step}"
            args = {"step": e.step}
        trace.append({"name": name, "cat": e.kind, "ph": "X", "pid": 0, "tid": e.stage,
                      "ts": e.start * time_unit_us, "dur": (e.end - e.start) * time_unit_us, "args": args})
    return {"traceEvents": trace, "displayTimeUnit": "ms", "otherData": result.summary()}

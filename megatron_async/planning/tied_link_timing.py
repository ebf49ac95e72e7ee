"""When tied input and output embeddings are exchanged between the first and last stage
under 2bw (pipeline/tied_embeddings.py), read off the real 2bw action lists by the simulator.

Batch b's embedding gradient (stage 0) and output-layer gradient (last stage) are both
taken at version b-1, so their sum is the tied gradient of the one-step-delay twin. The
last stage sends its part to stage 0, which steps the one weight and sends version b+1
back; the last stage needs it when it snapshots its weights at its step b+1 (its batch
b+2 runs at version b+1). Two windows decide whether this stalls:

- gradient: from the end of the last stage's last backward of batch b to the start of
  stage 0's step b, where the runtime adds it (or, if it had to be in stage 0's buffer
  before that buffer's data-parallel reduction starts, to the start of stage 0's last
  backward of batch b);
- weights: from the end of stage 0's step b to the start of the last stage's step b+1.

A window shorter than the transfer stalls a stage by the difference.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_async.schedules.actions import Backward, Forward, OptimizerStep, passes
from megatron_async.schedules.gen_2bw import two_bw, version_2bw
from megatron_async.schedules.simulator import simulate


@dataclass(frozen=True)
class TiedWindows:
    """The shortest windows over the steady batches, in the simulator's time units."""

    grad_before_step: float  # last stage's last backward of b ends -> stage 0's step b starts
    grad_before_last_backward: float  # ... -> stage 0's last backward of b starts
    weights_before_next_step: float  # stage 0's step b ends -> last stage's step b+1 starts


def tied_windows(num_stages: int, microbatches: int, fwd: float = 1.0, bwd: float = 2.0, opt: float = 0.0,
                 p2p: float = 0.0, batches: int = 6, lag: int = 1) -> TiedWindows:
    """Simulate `batches` batches of the 2bw lists and measure the windows of batches 1..batches-3
    (the first batch has no steady predecessor; the last two have no next step). `lag`: the
    last stage's step b+lag is the first that needs version b+1 (1 under 2bw's version rule;
    0 is what a weight without the one-step delay would need)."""
    p, m = num_stages, microbatches
    lists = two_bw(p, m, batches)
    sim = simulate(lists, fwd=fwd, bwd=bwd, opt=opt, p2p=p2p)
    ends = {(s, a): sim.action_ends[s][i] for s, acts in enumerate(lists) for i, a in enumerate(acts)}
    grad_step, grad_backward, weights = [], [], []
    for b in range(1, batches - 2):
        last = Backward((b + 1) * m - 1, version_2bw((b + 1) * m - 1, m))
        ready = ends[(p - 1, last)]
        grad_step.append(ends[(0, OptimizerStep(b))] - opt - ready)
        grad_backward.append(ends[(0, last)] - bwd - ready)
        weights.append(ends[(p - 1, OptimizerStep(b + lag))] - opt - ends[(0, OptimizerStep(b))])
    return TiedWindows(min(grad_step), min(grad_backward), min(weights))


def grad_receive_open(num_stages: int, microbatches: int, posted_at: str = "sent", fwd: float = 1.0,
                      bwd: float = 2.0, batches: int = 6) -> float:
    """How long stage 0's receive of batch b's gradient stays posted before the last stage
    sends it (the end of its last backward of b), over the steady batches, in the
    simulator's units; the batch period is m (F + B). `posted_at`: "sent", once batch b's
    last activation send is posted (the runtime); "first backward", at b's first backward
    (the alternative it is compared with). While posted it is device work that a whole-device wait on stage 0 waits
    for, and on NCCL a kernel spinning on stage 0's GPU."""
    p, m = num_stages, microbatches
    lists = two_bw(p, m, batches)
    sim = simulate(lists, fwd=fwd, bwd=bwd)
    ends = {(s, a): sim.action_ends[s][i] for s, acts in enumerate(lists) for i, a in enumerate(acts)}
    open_for = []
    for b in range(1, batches - 2):
        if posted_at == "sent":
            last_forward = Forward((b + 1) * m - 1, version_2bw((b + 1) * m - 1, m))
            posted = ends[(0, last_forward)]
        else:
            posted = ends[(0, Backward(b * m, version_2bw(b * m, m)))] - bwd
        last = Backward((b + 1) * m - 1, version_2bw((b + 1) * m - 1, m))
        open_for.append(ends[(p - 1, last)] - posted)
    return max(open_for)


def early_installs(lists) -> list[Forward]:
    """The last stage's forwards at a version v >= 1 that run before its OptimizerStep(v): the
    tied link installs the first stage's version v there (TwoBWRunner.live_forward) instead of
    at that step (pipeline/tied_embeddings.py). 2bw's own lists have none (the last stage runs
    batch v+1 only after its step v); a deeper warm-up there (the combined-step lists of
    gen_2bw_paired, one forward) has one a batch."""
    installed, early = 0, []  # the newest version installed (step v installs v)
    for action in lists[-1]:
        if isinstance(action, OptimizerStep):
            installed = max(installed, action.step)
            continue
        for x in passes(action):
            if isinstance(x, Forward) and x.version > installed:
                early.append(x)
                installed = x.version
    return early


def sent_before(lists, forward: Forward) -> bool:
    """Whether the first stage's list runs its OptimizerStep(v-1), after which it sends version
    v, before its own forward of `forward`'s microbatch: then the last stage's install at that
    forward waits for nothing the last stage does later (the microbatch's activation reaches it
    only through that forward)."""
    for action in lists[0]:
        if isinstance(action, OptimizerStep) and action.step == forward.version - 1:
            return True
        if any(isinstance(x, Forward) and x.microbatch == forward.microbatch for x in passes(action)):
            return False
    return False


def early_install_window(num_stages: int, microbatches: int, fwd: float = 1.0, bwd: float = 2.0,
                         pair: float | None = None, batches: int = 6) -> float:
    """From the end of the first stage's step v-1 (after which it sends version v) to the start
    of the last stage's early install of v (its first forward at v, `early_installs`), shortest over
    the combined-step lists' batches, in the simulator's units: how long the transfer of the
    weights may take before that forward waits for it. `pair`: a combined step's cost."""
    from megatron_async.schedules.gen_2bw_paired import two_bw_paired

    lists = two_bw_paired(num_stages, microbatches, batches)
    events = simulate(lists, fwd=fwd, bwd=bwd, pair=pair).events
    step_end = {e.step: e.end for e in events if e.stage == 0 and e.kind == "optimizer"}
    # a combined step's event carries its forward's microbatch
    start = {e.microbatch: e.start for e in events
             if e.stage == num_stages - 1 and e.kind in ("forward", "forward_backward")}
    return min(start[f.microbatch] - step_end[f.version - 1] for f in early_installs(lists))

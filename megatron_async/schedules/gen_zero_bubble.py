"""Zero-bubble schedules (Qi et al., ICLR 2024): the backward split in two.

A backward computes the input gradient (`BackwardInput`, which the previous stage
waits for) and the weight gradients (`BackwardWeight`, which nothing waits for).
Running the weight gradients later fills the pipeline's bubbles. Both schedules
here are synchronous: every microbatch of batch b uses version b and each stage
steps after its last weight gradient of the batch, as 1F1B does.

- ZB-H1: 1F1B's order and activation memory on one piece per stage; stage s runs
  the weight gradient of a microbatch s input gradients late, so the later stages
  pass input gradients back sooner and spend the flush's wait on deferred weight
  gradients. Bubble (p-1)(F + I - W) against 1F1B's (p-1)(F + I + W), with F, I,
  W the three passes' costs.
- ZB-V: two pieces per stage in a V (stage 0 holds the first and the last piece),
  the order of the paper's section 6: with F = I = W its bubble vanishes when
  m >= 2p - 1. Fewer microbatches leave some of the order unused (the paper pads
  to 2p - 1).
"""

from __future__ import annotations

from megatron_async.schedules.actions import (
    Action,
    BackwardInput,
    BackwardWeight,
    Forward,
    OptimizerStep,
    Placement,
)
from megatron_async.schedules.gen_common import add_communication, check_sizes


def _zb_h1_batch(mbs: list[int], version: int, warmup: int, lag: int) -> list[Action]:
    """One batch of one stage: 1F1B with each weight gradient `lag` input gradients late."""
    m, warmup = len(mbs), min(warmup, len(mbs))
    acts: list[Action] = [Forward(k, version) for k in mbs[:warmup]]
    weights_done = 0

    def after_input(i: int) -> None:
        nonlocal weights_done
        if i - lag >= 0:
            acts.append(BackwardWeight(mbs[i - lag], version))
            weights_done += 1

    for i in range(m):
        if warmup + i < m:
            acts.append(Forward(mbs[warmup + i], version))
        acts.append(BackwardInput(mbs[i], version))
        after_input(i)
    acts += [BackwardWeight(k, version) for k in mbs[weights_done:]]
    acts.append(OptimizerStep(version))
    return acts


def zb_h1(num_stages: int, microbatches: int, batches: int = 1) -> list[list[Action]]:
    """ZB-H1 with a flush per batch (see module docstring)."""
    check_sizes(num_stages, microbatches, batches)
    compute = []
    for s in range(num_stages):
        acts = []
        for b in range(batches):
            mbs = list(range(b * microbatches, (b + 1) * microbatches))
            acts += _zb_h1_batch(mbs, b, warmup=num_stages - 1 - s, lag=s)
        compute.append(acts)
    return add_communication(compute)


def _zbv_order(p: int, s: int, m: int) -> list[tuple[str, int, int]]:
    """ZB-V's order at stage s as (pass, chunk, index of the microbatch within the
    batch), laid out for max(m, 2p - 1) microbatches; the caller drops indices >= m."""
    n = max(m, 2 * p - 1)
    count = dict.fromkeys([(kind, c) for kind in "FIW" for c in (0, 1)], 0)
    out = []

    def do(*passes: str) -> None:
        for name in passes:  # "F1": forward of chunk 1
            kind, chunk = name[0], int(name[1])
            out.append((kind, chunk, count[(kind, chunk)]))
            count[(kind, chunk)] += 1

    for _ in range(2 * (p - s) - 1):  # chunk 0 fills the way down
        do("F0")
    for _ in range(s):  # forwards of both chunks alternate until the V turns
        do("F1", "F0")
    for _ in range(p - s):  # the first chunk-1 microbatches finish right away
        do("F1", "I1", "W1")
    while count[("F", 1)] < count[("F", 0)] or count[("F", 0)] < n:  # steady state
        if count[("F", 0)] < n:
            do("F0")
        do("I0", "W0", "F1", "I1", "W1")
    for _ in range(s):  # cool-down: input gradients first ...
        do("I0", "I1")
    for _ in range(p - s):
        do("I0", "W0")
    while count[("W", 1)] < count[("I", 1)]:  # ... then the weight gradients left
        do("W1")
    while count[("W", 0)] < count[("I", 0)]:
        do("W0")
    return out


def zbv(num_stages: int, microbatches: int, batches: int = 1) -> list[list[Action]]:
    """ZB-V with a flush per batch, on `Placement.vee` (two pieces per stage)."""
    check_sizes(num_stages, microbatches, batches)
    kinds = {"F": Forward, "I": BackwardInput, "W": BackwardWeight}
    compute = []
    for s in range(num_stages):
        order = _zbv_order(num_stages, s, microbatches)
        acts = []
        for b in range(batches):
            acts += [kinds[kind](b * microbatches + j, b, chunk)
                     for kind, chunk, j in order if j < microbatches]
            acts.append(OptimizerStep(b))
        compute.append(acts)
    return add_communication(compute, Placement.vee(num_stages))

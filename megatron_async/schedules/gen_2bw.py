"""PipeDream-2BW: 1F1B with no flush between batches and a constant one-step delay.

Stage s runs p-1-s warm-up forwards once at the start, then steady 1F1B across batch
boundaries, then one cool-down at the end. It steps its optimizer right after its
own last backward of each batch. Version rule: every microbatch of batch b uses
version max(b-1, 0) in forward and backward, at every stage, so the step of batch b
applies grad f(W(b-1)) to W(b): W(b+1) = W(b) - lr * U(grad f(W(b-1))).

Bound on m. At stage s the first forward of batch b runs right after the backward
of microbatch b*m - (p-1-s) - 1, and it needs version b-1, which the step after the
last backward of batch b-2 (microbatch (b-1)*m - 1) produces. That step has run iff
(b-1)*m - 1 <= b*m - (p-1-s) - 1, i.e. m >= p-1-s; stage 0 binds: m >= p-1.
Two versions always suffice once that holds: if b is the oldest batch with an
unfinished microbatch on a stage, step b has not run there (newest version <= b) and
no earlier batch needs anything, so only b-1 and b are held. (PipeDream-2BW's
m >= p is sufficient, not tight, for this rule.)
"""

from __future__ import annotations

from megatron_async.schedules.actions import Action, Backward, Forward, OptimizerStep
from megatron_async.schedules.gen_common import add_communication, check_microbatch_bound, one_f_one_b


def min_microbatches_2bw(num_stages: int) -> int:
    """Smallest m for which the 2BW version rule works with two weight versions."""
    return max(num_stages - 1, 1)


def version_2bw(microbatch: int, microbatches: int) -> int:
    return max(microbatch // microbatches - 1, 0)


def two_bw(num_stages: int, microbatches: int, batches: int = 1) -> list[list[Action]]:
    bound = min_microbatches_2bw(num_stages)
    check_microbatch_bound(
        num_stages, microbatches, batches, bound,
        f"2bw needs at least p-1 = {bound} microbatches per batch with {num_stages} pipeline "
        f"stages (else batch b's first forward at stage 0 would need version b-1 before it "
        f"exists), got m = {microbatches}; m = --global-batch-size / (--micro-batch-size * "
        f"data-parallel size)")
    total = microbatches * batches
    compute = []
    for s in range(num_stages):
        acts = []
        for kind, k in one_f_one_b(range(total), num_stages - 1 - s):
            v = version_2bw(k, microbatches)
            if kind == "F":
                acts.append(Forward(k, v))
            else:
                acts.append(Backward(k, v))
                if k % microbatches == microbatches - 1:
                    acts.append(OptimizerStep(k // microbatches))
        compute.append(acts)
    return add_communication(compute)

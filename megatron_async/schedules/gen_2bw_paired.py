"""2bw with Megatron's combined forward-backward step (`--overlap-moe-expert-parallel-comm`).

2bw's steady state is one forward and one backward per slot, batch after batch, with
no flush: every slot can be a combined step (`ForwardBackward`), whose forward hides
its expert all-to-all behind the backward's compute and the other way round. A
combined step hands on its activation and its gradient only when it ends, and that
decides the warm-up.

Write w_s for stage s's warm-up forwards and i for the i-th combined step, forward
i + w_s beside backward i. Step i on stage s needs gradient i from stage s+1's step i,
which needs activation i + w_{s+1} from stage s's step i - (w_s - w_{s+1}). With
2bw's own warm-up, w_s - w_{s+1} = 1: each step waits on its neighbour's step, which
waits on this stage's previous one, and the pipeline runs one step per two steps'
time, slower than not pairing. With w_s - w_{s+1} = 2 the chain skips a step and
every stage runs one step after another: w_s = 2(p-1-s) + 1, Megatron's interleaved
warm-up term 2(p-rank-1) plus the one forward its combined schedule adds.

Versions follow 2bw's rule (gen_2bw): every microbatch of batch b uses version
max(b-1, 0). The first forward of batch b on stage s runs in the step beside
backward b*m - w_s and needs version b-1, made by the step after backward
(b-1)*m - 1, so m >= w_s; stage 0 binds: m >= 2p-1. Two versions then suffice (the
validator shows it). The price is memory: stage s holds up to w_s + 1 = 2(p-s)
microbatches' activations, its warm-up and the step's new forward beside the
backward that frees one; about 2p on stage 0 where 2bw holds p.
"""

from __future__ import annotations

from typing import Callable

from megatron_async.schedules.actions import Action, Backward, Forward, ForwardBackward, OptimizerStep
from megatron_async.schedules.gen_2bw import version_2bw
from megatron_async.schedules.gen_common import add_communication, check_microbatch_bound, check_sizes, one_f_one_b_paired


def warmup_2bw_paired(num_stages: int, stage: int) -> int:
    """Forwards stage `stage` runs before its first combined step (module docstring)."""
    return 2 * (num_stages - 1 - stage) + 1


def min_microbatches_2bw_paired(num_stages: int) -> int:
    """Smallest m for which the paired lists keep 2bw's version rule with two versions."""
    return warmup_2bw_paired(num_stages, 0)


def paired_2bw(num_stages: int, microbatches: int, batches: int,
               warmup: Callable[[int], int]) -> list[list[Action]]:
    """2bw's lists with every steady forward-backward slot one combined step, after
    `warmup(s)` forwards on stage s; no bound on m is checked (`two_bw_paired` checks it)."""
    check_sizes(num_stages, microbatches, batches)
    total = microbatches * batches
    compute = []
    for s in range(num_stages):
        acts = []
        for kind, item in one_f_one_b_paired(range(total), range(total), warmup(s)):
            if kind == "F":
                acts.append(Forward(item, version_2bw(item, microbatches)))
                continue
            k = item[1] if kind == "FB" else item
            backward = Backward(k, version_2bw(k, microbatches))
            if kind == "FB":
                acts.append(ForwardBackward(Forward(item[0], version_2bw(item[0], microbatches)), backward))
            else:
                acts.append(backward)
            if k % microbatches == microbatches - 1:
                acts.append(OptimizerStep(k // microbatches))
        compute.append(acts)
    return add_communication(compute)


def two_bw_paired(num_stages: int, microbatches: int, batches: int = 1) -> list[list[Action]]:
    """The lists 2bw runs with --overlap-moe-expert-parallel-comm: the deeper warm-up,
    then combined steps (module docstring)."""
    bound = min_microbatches_2bw_paired(num_stages)
    check_microbatch_bound(
        num_stages, microbatches, batches, bound,
        f"2bw with --overlap-moe-expert-parallel-comm needs at least 2p-1 = {bound} microbatches per batch "
        f"with {num_stages} pipeline stages (--pipeline-model-parallel-size): stage 0 runs {bound} forwards "
        f"before its first combined step, so batch b's first forward would need version b-1 before it "
        f"exists; got m = {microbatches}. Raise --global-batch-size (m = --global-batch-size / "
        f"(--micro-batch-size * data-parallel size)) or drop --overlap-moe-expert-parallel-comm")
    return paired_2bw(num_stages, microbatches, batches, lambda s: warmup_2bw_paired(num_stages, s))

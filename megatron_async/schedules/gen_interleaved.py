"""Megatron's interleaved 1F1B as action lists: v pieces per stage, flush per batch.

Stage s holds pieces s, p + s, ..., (v-1)p + s (`Placement.interleaved`). It runs
m·v forward and backward passes per batch in Megatron-Core's order: forwards go
through the chunks in groups of p microbatches (chunk 0 for microbatches 0..p-1,
then chunk 1 for the same ones, ...), backwards the same way from the last chunk,
after (p - s - 1)·2 + (v - 1)·p warm-up forwards. Megatron-Core's default group
is p microbatches, so m must be a multiple of p here. This is what the simulator
and the cost model use for interleaved 1F1B; the runtime is Megatron's own.
"""

from __future__ import annotations

from megatron_async.schedules.actions import Action, Backward, Forward, OptimizerStep, Placement
from megatron_async.schedules.gen_common import add_communication, check_sizes


def _virtual(k: int, p: int, v: int, backward: bool) -> tuple[int, int]:
    """(microbatch within the batch, chunk) of the k-th forward or backward pass."""
    group, r = divmod(k, p * v)
    chunk = r // p
    return group * p + r % p, (v - 1 - chunk) if backward else chunk


def interleaved_1f1b(num_stages: int, microbatches: int, batches: int = 1,
                     chunks: int = 2) -> list[list[Action]]:
    check_sizes(num_stages, microbatches, batches)
    p, m, v = num_stages, microbatches, chunks
    if m % p:
        raise ValueError(f"interleaved 1F1B needs the microbatches per batch ({m}) to be a multiple of "
                         f"the pipeline stages ({p}), as Megatron-Core's default grouping does")
    total = m * v
    compute = []
    for s in range(p):
        warmup = min((p - s - 1) * 2 + (v - 1) * p, total)
        acts: list[Action] = []
        for b in range(batches):
            def fwd(k):
                j, c = _virtual(k, p, v, backward=False)
                return Forward(b * m + j, b, c)

            def bwd(k):
                j, c = _virtual(k, p, v, backward=True)
                return Backward(b * m + j, b, c)

            acts += [fwd(k) for k in range(warmup)]
            for i in range(total - warmup):
                acts += [fwd(warmup + i), bwd(i)]
            acts += [bwd(k) for k in range(total - warmup, total)]
            acts.append(OptimizerStep(b))
        compute.append(acts)
    return add_communication(compute, Placement.interleaved(p, v))

"""Megatron's interleaved 1F1B as action lists: v pieces per stage, flush per batch.

Stage s holds pieces s, p + s, ..., (v-1)p + s (`Placement.interleaved`). It runs
m·v forward and backward passes per batch in Megatron-Core's order: forwards go
through the chunks in groups of p microbatches (chunk 0 for microbatches 0..p-1,
then chunk 1 for the same ones, ...), backwards the same way from the last chunk,
after (p - s - 1)·2 + (v - 1)·p warm-up forwards. Megatron-Core's default group
is p microbatches, so m must be a multiple of p here. This is what the simulator
and the cost model use for interleaved 1F1B; the runtime is Megatron's own.

With `--overlap-moe-expert-parallel-comm` Megatron runs one more warm-up forward and
then each steady forward-backward slot as one combined step, whose sends leave when
it ends (`interleaved_1f1b_paired`); the warm-up and cool-down passes run alone.
"""

from __future__ import annotations

from megatron_async.schedules.actions import Action, Backward, Forward, ForwardBackward, OptimizerStep, Placement
from megatron_async.schedules.gen_common import add_communication, check_sizes, one_f_one_b, one_f_one_b_paired


def _virtual(k: int, p: int, v: int, backward: bool) -> tuple[int, int]:
    """(microbatch within the batch, chunk) of the k-th forward or backward pass."""
    group, r = divmod(k, p * v)
    chunk = r // p
    return group * p + r % p, (v - 1 - chunk) if backward else chunk


def _interleaved(num_stages: int, microbatches: int, batches: int, chunks: int, paired: bool) -> list[list[Action]]:
    """Megatron's order, with `paired` its combined steps; one function so both share the order."""
    check_sizes(num_stages, microbatches, batches)
    p, m, v = num_stages, microbatches, chunks
    if m % p:
        raise ValueError(f"interleaved 1F1B needs the microbatches per batch ({m}) to be a multiple of "
                         f"the pipeline stages ({p}), as Megatron-Core's default grouping does")
    total = m * v
    compute = []
    for s in range(p):
        warmup = min((p - s - 1) * 2 + (v - 1) * p + (1 if paired else 0), total)
        if paired:
            order = one_f_one_b_paired([_virtual(k, p, v, backward=False) for k in range(total)],
                                       [_virtual(k, p, v, backward=True) for k in range(total)], warmup,
                                       microbatch=lambda item: item[0])
        else:
            order = [(kind, _virtual(k, p, v, backward=kind == "B")) for kind, k in one_f_one_b(range(total), warmup)]
        acts: list[Action] = []
        for b in range(batches):
            def fwd(item):
                return Forward(b * m + item[0], b, item[1])

            def bwd(item):
                return Backward(b * m + item[0], b, item[1])

            for kind, item in order:
                acts.append(fwd(item) if kind == "F" else bwd(item) if kind == "B"
                            else ForwardBackward(fwd(item[0]), bwd(item[1])))
            acts.append(OptimizerStep(b))
        compute.append(acts)
    return add_communication(compute, Placement.interleaved(p, v))


def interleaved_1f1b(num_stages: int, microbatches: int, batches: int = 1,
                     chunks: int = 2) -> list[list[Action]]:
    return _interleaved(num_stages, microbatches, batches, chunks, paired=False)


def interleaved_1f1b_paired(num_stages: int, microbatches: int, batches: int = 1,
                            chunks: int = 2) -> list[list[Action]]:
    """Megatron's interleaved 1F1B with --overlap-moe-expert-parallel-comm: one more
    warm-up forward (get_pp_rank_microbatches), then every steady forward-backward
    slot one combined step (combined_1f1b_schedule_for_interleaved_pipelining)."""
    return _interleaved(num_stages, microbatches, batches, chunks, paired=True)

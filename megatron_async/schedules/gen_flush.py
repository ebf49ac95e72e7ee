"""Synchronous schedules: GPipe and 1F1B (PipeDream-flush, Megatron's default).

Both flush the pipeline at every batch boundary: each stage steps its optimizer
right after its last backward of batch b, and every microbatch of batch b uses
version b, the weights all previous batches produced. No stashing, no delay.
"""

from __future__ import annotations

from megatron_async.schedules.actions import Action, Backward, Forward, OptimizerStep
from megatron_async.schedules.gen_common import add_communication, check_sizes, one_f_one_b


def _flushed(num_stages: int, microbatches: int, batches: int, warmup) -> list[list[Action]]:
    check_sizes(num_stages, microbatches, batches)
    compute = []
    for s in range(num_stages):
        acts = []
        for b in range(batches):
            mbs = range(b * microbatches, (b + 1) * microbatches)
            for kind, k in one_f_one_b(mbs, warmup(s)):
                acts.append(Forward(k, b) if kind == "F" else Backward(k, b))
            acts.append(OptimizerStep(b))
        compute.append(acts)
    return add_communication(compute)


def gpipe(num_stages: int, microbatches: int, batches: int = 1) -> list[list[Action]]:
    """All forwards of a batch, then all its backwards, then the optimizer step."""
    return _flushed(num_stages, microbatches, batches, lambda s: microbatches)


def one_f_one_b_flush(num_stages: int, microbatches: int, batches: int = 1) -> list[list[Action]]:
    """1F1B per batch: p-1-s warm-up forwards at stage s, steady 1F1B, cool-down, flush."""
    return _flushed(num_stages, microbatches, batches, lambda s: num_stages - 1 - s)

"""The 2bw runner as the tests' small trainer: it steps its own optimizer at each
OptimizerStep (Megatron's loop steps it through a DelayedStepOptimizer instead), reads
microbatch k from `get_microbatch(k)`, and evaluates a list of microbatch dicts."""

from __future__ import annotations

from typing import Callable

from megatron_async.pipeline.delayed_step import delayed_optimizer_step
from megatron_async.pipeline.two_bw import TwoBWRunner


class SelfSteppingRunner(TwoBWRunner):
    """TwoBWRunner whose OptimizerStep(t) also steps `optimizer` (the one delayed step)."""

    def __init__(self, context, stream_for, optimizer, num_batches: int, **kwargs):
        super().__init__(context, stream_for, num_batches, **kwargs)
        self.optimizer = optimizer

    def optimizer_step(self, step: int):
        super().optimizer_step(step)
        result = delayed_optimizer_step(self.optimizer, self.stash, self.stale_norm, self, step + 1, self.links.stage)
        self.model.zero_grad_buffer()  # Megatron's train_step does this on the other path
        return result


def microbatch_data(get_microbatch: Callable[[int], dict]):
    """data_for(k): an iterator over microbatch k alone, for Megatron's forward step."""
    return lambda k: iter([get_microbatch(k)])


def evaluate_microbatches(runner: TwoBWRunner, microbatches: list[dict]) -> list:
    """Forward-only pass over `microbatches` at the newest weights; loss reports on the last stage."""
    return runner.evaluate_iterators(iter([batch]) for batch in microbatches)

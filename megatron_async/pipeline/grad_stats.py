"""Keep the optimizer's gradient statistics inside one pipeline stage.

Megatron reduces the gradient norm (for clipping and logging) and the zero count
over the model-parallel group (TP x PP), or the whole world with the distributed
optimizer: a blocking collective across pipeline stages at every step, which in an
asynchronous pipeline re-creates the bubble that 2BW removes. `make_stage_local`
points each (sub-)optimizer at the ranks of its own stage instead:

- non-distributed optimizer: the tensor-parallel group (gradients are replicated
  across data-parallel ranks after the all-reduce, so DP must not be summed);
- distributed optimizer: tensor x data parallel ranks of the stage (each DP rank
  holds a shard of the reduced gradient).

Clipping with `--clip-grad` then uses the stage's own gradient norm
(`--clip-grad-mode stage-local`).
"""

from __future__ import annotations

from megatron.core import parallel_state


def _sub_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def stage_local_group(distributed: bool):
    if distributed:
        return parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    return parallel_state.get_tensor_model_parallel_group()


def make_stage_local(optimizer, distributed: bool) -> None:
    group = stage_local_group(distributed)
    for sub in _sub_optimizers(optimizer):
        sub.grad_stats_parallel_group = group

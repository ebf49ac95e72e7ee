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


def _stage_of(name: str, num_layers: int, num_stages: int) -> int:
    """Pipeline stage that would own parameter `name` of an unsplit GPT."""
    parts = name.split(".")
    if "layers" in parts:
        layer = int(parts[parts.index("layers") + 1])
        return layer // (num_layers // num_stages)
    if "embedding" in parts:
        return 0
    return num_stages - 1  # final layernorm, output layer


def clip_like_pipeline_stages(model, num_layers: int, num_stages: int) -> None:
    """Make an unpipelined model clip each would-be stage by its own gradient norm.

    With `--simulated-delay` this reproduces `--clip-grad-mode stage-local` of a
    P-stage 2bw run exactly. It reuses Megatron's separate grad-norm groups: the
    parameters of stage s > 0 are tagged with group "pipeline-stage-s", which
    Megatron's optimizer excludes from the main norm and clips by its own norm.
    Call before the optimizer is built.
    """
    from megatron.core.optimizer import optimizer as mcore_optimizer

    groups = tuple(f"pipeline-stage-{s}" for s in range(1, num_stages))
    missing = tuple(g for g in groups if g not in mcore_optimizer.SEPARATE_GRAD_NORM_GROUPS)
    mcore_optimizer.SEPARATE_GRAD_NORM_GROUPS = mcore_optimizer.SEPARATE_GRAD_NORM_GROUPS + missing
    for chunk in model:
        for name, param in chunk.named_parameters():
            stage = _stage_of(name, num_layers, num_stages)
            if stage > 0:
                setattr(param, mcore_optimizer.GRAD_NORM_GROUP_ATTR, f"pipeline-stage-{stage}")

"""Keep the optimizer's gradient statistics inside one pipeline stage.

Megatron reduces the gradient norm (for clipping and logging) and the zero count
over the model-parallel group (TP x PP), or the whole world with the distributed
optimizer: a blocking collective across pipeline stages at every step, which in an
asynchronous pipeline re-creates the bubble that 2BW removes. `make_stage_local`
points each (sub-)optimizer at the ranks of its own stage instead:

- non-distributed optimizer: the tensor-parallel group (gradients are replicated
  across data-parallel ranks after the all-reduce, so DP must not be summed), and
  for Megatron's expert sub-optimizer the expert tensor x expert-parallel group;
- distributed optimizer: tensor x data parallel ranks of the stage (each DP rank
  holds a shard of the reduced gradient);
- Megatron's layer-wise distributed optimizer (emerging optimizers such as Muon
  with --use-distributed-optimizer): the same ranks, since each DP rank owns whole
  parameters. It reduces over all ranks (group=None) in its own methods, which a
  subclass (`_StageLocalStatistics` mixed into the optimizer's class) points at the stage
  (its STAGE_LOCAL_STATISTICS entry of the delayed-run patches, pipeline/delayed_run_patches.py).

Clipping with `--clip-grad` then uses the stage's own gradient norm
(`--clip-grad-mode stage-local`).
"""

from __future__ import annotations

from megatron_async import patch_table
from megatron_async.patch_table import Patch, Scope


def _sub_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def stage_local_group(groups, distributed: bool, expert: bool = False):
    """Ranks of this stage (of the run's process groups, Megatron-Core's ProcessGroupCollection)
    over which a (sub-)optimizer's gradient statistics sum.

    Expert weights differ across expert-parallel ranks, so their statistics also
    sum over those (Megatron's expert sub-optimizer is built apart for this); with
    the distributed optimizer every rank of the stage holds its own shard of both.
    """
    if distributed:
        return groups.tp_dp_cp
    if expert:
        return groups.tp_ep
    return groups.tp


def _holds_expert_weights(sub) -> bool:
    # Megatron marks expert-parallel parameters with allreduce=False
    return any(not getattr(p, "allreduce", True) for p in sub.get_parameters())


def _is_layer_wise(optimizer) -> bool:
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer

    return isinstance(optimizer, LayerWiseDistributedOptimizer)


def make_stage_local(optimizer, distributed: bool, groups) -> list:
    """Returns what it patched (patch_table.restore undoes it)."""
    layer_wise = _is_layer_wise(optimizer)
    group = stage_local_group(groups, distributed or layer_wise)
    for sub in _sub_optimizers(optimizer):
        sub.grad_stats_parallel_group = stage_local_group(groups, distributed or layer_wise, _holds_expert_weights(sub))
    installed: list = []
    if layer_wise:
        patch_table.install((STAGE_LOCAL_STATISTICS,), installed, objects={"<optimizer>": optimizer})
        optimizer.stage_group = group
    return installed


class _StageLocalStatistics:
    """Megatron's layer-wise distributed optimizer with its gradient norm, grad-norm group
    check and zero count over `stage_group` (the ranks of one pipeline stage), where
    Megatron-Core 0.19.2 reduces over the world (group=None, layer_wise_optimizer.py)
    and offers no setting for it. Its methods go into a subclass of the optimizer's class; the norm goes
    through optimizer.get_grad_norm_fp32, looked up at call time, so
    `--clip-grad-mode stale-global` sees these calls too."""

    def get_grad_norm(self):
        return self._get_grad_norm_for_group(None)

    def _get_grad_norm_for_group(self, grad_norm_group=None):
        from megatron.core.optimizer import optimizer as mcore_optimizer

        grads = []
        for sub in self.chained_optimizers:
            grads += (sub.get_grads_for_grad_norm() if grad_norm_group is None
                      else sub.get_grads_for_grad_norm(grad_norm_group))
        return mcore_optimizer.get_grad_norm_fp32(grads, grad_stats_parallel_group=self.stage_group)

    def has_grad_norm_group(self, grad_norm_group) -> bool:
        import torch
        from megatron.core.optimizer import optimizer as mcore_optimizer

        cache = self.__dict__.setdefault("_stage_grad_norm_groups", {})
        if grad_norm_group not in cache:
            local = any(getattr(p, mcore_optimizer.GRAD_NORM_GROUP_ATTR, None) == grad_norm_group
                        for sub in self.chained_optimizers for p in sub.get_parameters())
            flag = torch.tensor([int(local)], dtype=torch.int, device="cuda")
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self.stage_group)
            cache[grad_norm_group] = bool(flag.item())
        return cache[grad_norm_group]

    def count_zeros(self):
        from megatron.core.optimizer.clip_grads import count_zeros_fp32

        params = [p for sub in self.chained_optimizers for p in sub.get_parameters()]
        return count_zeros_fp32(params, grad_stats_parallel_group=self.stage_group,
                                use_decoupled_grad=self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)


def stage_local_class(base: type) -> type:
    """A plain subclass of the optimizer's class with _StageLocalStatistics' methods (a mixin
    base would change the instance layout Python checks on a class change)."""
    methods = {name: value for name, value in vars(_StageLocalStatistics).items() if callable(value)}
    return type(f"StageLocal{base.__name__}", (base,), {**methods, "__doc__": _StageLocalStatistics.__doc__})


def _stage_local_class(optimizer):
    """The optimizer becomes an instance of a subclass of its class with _StageLocalStatistics'
    methods (isinstance of Megatron's class still holds; its state is untouched)."""
    base = type(optimizer)
    optimizer.__class__ = stage_local_class(base)
    return base


def _restore_class(optimizer, base) -> None:
    optimizer.__class__ = base


def _with_stage_groups(original, num_stages):
    groups = tuple(f"pipeline-stage-{s}" for s in range(1, num_stages))
    missing = tuple(g for g in groups if g not in original)
    return original + missing if missing else original


STAGE_LOCAL_STATISTICS = Patch(
    "<optimizer>", "__class__", "2bw with Megatron's layer-wise distributed optimizer: its gradient norm, "
    "grad-norm group check and zero count over the stage's ranks, not the world", _stage_local_class,
    Scope.DELAYED, restore=_restore_class)
STAGE_NORM_GROUPS = Patch(
    "megatron.core.optimizer.optimizer", "SEPARATE_GRAD_NORM_GROUPS", "--simulated-delay with "
    "--simulated-pipeline-stages: each would-be stage clipped by its own norm", _with_stage_groups, Scope.DELAYED)


def stage_of_parameter(name: str, num_layers: int, num_stages: int) -> int:
    """Pipeline stage that would own parameter `name` of an unsplit GPT."""
    parts = name.split(".")
    if "mtp" in parts:  # multi-token prediction layers follow the output layer
        return num_stages - 1
    if "layers" in parts:
        layer = int(parts[parts.index("layers") + 1])
        return layer // (num_layers // num_stages)
    if "embedding" in parts:
        return 0
    return num_stages - 1  # final layernorm, output layer


def clip_like_pipeline_stages(model, num_layers: int, num_stages: int) -> list:
    """Make an unpipelined model clip each would-be stage by its own gradient norm.

    With `--simulated-delay` this reproduces `--clip-grad-mode stage-local` of a
    P-stage 2bw run exactly. It reuses Megatron's separate grad-norm groups: the
    parameters of stage s > 0 are tagged with group "pipeline-stage-s", which
    Megatron's optimizer excludes from the main norm and clips by its own norm.
    Call before the optimizer is built. Returns what it patched (patch_table.restore undoes it).
    """
    from megatron.core.optimizer import optimizer as mcore_optimizer

    installed: list = []
    patch_table.install((patch_table.bound(STAGE_NORM_GROUPS, num_stages=num_stages),), installed)
    for chunk in model:
        for name, param in chunk.named_parameters():
            stage = stage_of_parameter(name, num_layers, num_stages)
            if stage > 0:
                setattr(param, mcore_optimizer.GRAD_NORM_GROUP_ATTR, f"pipeline-stage-{stage}")
    return installed

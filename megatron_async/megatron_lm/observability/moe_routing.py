"""What the routers of an MoE model did each training iteration, for `--metrics-json`.

Megatron-Core 0.19.2 logs the load-balancing (aux) loss per layer, but not how
unevenly the tokens fell on the experts. Whether a one-step weight delay disturbs
routing is read off both, so each training iteration gets one record:

    {"iteration": N, "moe_aux_loss": mean over layers, "moe_aux_loss_layers": [...],
     "moe_load_imbalance": mean over layers, "moe_load_imbalance_layers": [...]}

- the aux loss is Megatron's own value, taken where its `MoEMetricsTracker` averages
  it (`_aggregate`, after its reductions; under 2bw those stay inside the stage);
- a layer's load imbalance is max / mean tokens per expert over the iteration's
  training microbatches, counted by a forward hook on each `TopKRouter`
  (`routing_map`, tokens x experts), summed over the stage's tensor and data-parallel
  ranks. Every rank counts its own layers, so at PP > 1 the record (written by the
  last rank) holds the last stage's layers and null for the others.
"""

from __future__ import annotations

import torch

class RoutingCounts:
    """One run's routed-token counts and Megatron's aux losses, between two records
    (megatron_lm/adapter/plugin_run.PluginRun holds it)."""

    def __init__(self):
        self.counts: dict = {}  # layer number -> tokens per expert
        self.aux = None
        self.handles: list = []

    def count(self, router, _inputs, output) -> None:
        """A TopKRouter's forward hook."""
        if not router.training or router.layer_number is None:
            return
        routing_map = output[1]
        tokens = routing_map.detach().reshape(-1, routing_map.shape[-1]).sum(dim=0, dtype=torch.float64)
        self.counts[router.layer_number] = self.counts.get(router.layer_number, 0) + tokens

    def attach(self, model_chunks) -> int:
        """Count routed tokens in every TopKRouter of `model_chunks`; the number of routers."""
        from megatron.core.transformer.moe.router import TopKRouter

        for handle in self.handles:
            handle.remove()
        self.handles = [m.register_forward_hook(self.count) for chunk in model_chunks for m in chunk.modules()
                        if isinstance(m, TopKRouter)]
        self.counts = {}
        return len(self.handles)

    def capture_aux(self, tracker, loss_scale: float, metric_names) -> None:
        """Called from MoEMetricsTracker._aggregate: its per-layer values, as it logs them."""
        entry = tracker.metrics.get("load_balancing_loss") if "load_balancing_loss" in metric_names else None
        self.aux = None if entry is None else (entry.values.float() * loss_scale).tolist()

    def take_record(self, iteration: int, num_layers: int, num_experts: int) -> dict | None:
        """This iteration's routing record (every rank must call it: it reduces within the
        stage), then clears the counts; None when no router ran."""
        counts, aux = self.counts, self.aux
        self.counts, self.aux = {}, None
        if not self.handles:
            return None
        return _record(iteration, counts, aux, num_layers, num_experts)


def imbalance(counts: torch.Tensor) -> float:
    """max / mean tokens per expert (1.0: perfectly even; num_experts: all on one)."""
    mean = counts.mean()
    return float(counts.max() / mean) if mean > 0 else float("nan")


def _stage_sum(counts: torch.Tensor) -> torch.Tensor:
    """Sum over this stage's tensor and data-parallel ranks (never across stages)."""
    from megatron.core import parallel_state

    groups = [parallel_state.get_tensor_model_parallel_group(),
              parallel_state.get_data_parallel_group(with_context_parallel=True)]
    for group in groups:
        if torch.distributed.get_world_size(group) > 1:
            torch.distributed.all_reduce(counts, group=group)
    return counts


def _record(iteration: int, counts: dict, aux, num_layers: int, num_experts: int) -> dict:
    table = torch.zeros(num_layers, num_experts, dtype=torch.float64)
    for layer, tokens in counts.items():
        table[layer - 1] = tokens.cpu()
    # every rank of the stage reduces the same table shape: the layers it lacks are zeros
    device = "cuda" if torch.cuda.is_available() else "cpu"
    table = _stage_sum(table.to(device)).cpu() if torch.distributed.is_initialized() else table
    layers = [imbalance(row) if row.sum() > 0 else None for row in table]
    held = [x for x in layers if x is not None]
    record = {"iteration": iteration, "moe_load_imbalance": sum(held) / len(held) if held else None,
              "moe_load_imbalance_layers": layers}
    if aux is not None:
        held_aux = [a for a, layer in zip(aux, layers) if layer is not None]
        record["moe_aux_loss"] = sum(held_aux) / len(held_aux) if held_aux else None
        record["moe_aux_loss_layers"] = [a if layer is not None else None for a, layer in zip(aux, layers)]
    return record

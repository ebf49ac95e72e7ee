"""The split of whole layers over pipeline stages that makes the slowest stage fastest.

Under 2bw there is no bubble to hide behind: the pipeline runs at its slowest stage's
pace. A stage's time is its layers' plus what only it holds: the first stage the
embedding, the last the output layer, the loss and the multi-token-prediction layers
(and each end its share of the tied link). Megatron splits layers evenly unless told
otherwise; `best_split` finds the split that minimises the slowest stage (an exact
dynamic programme over contiguous splits, every stage at least one layer; the most even
of the best) and `megatron_flags` writes it as Megatron's own flags.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence


@dataclass(frozen=True)
class Split:
    layers: tuple[int, ...]  # transformer layers per stage, first to last
    stage_costs: tuple[float, ...]

    @property
    def slowest(self) -> float:
        return max(self.stage_costs)

    @property
    def imbalance(self) -> float:
        """How far the slowest stage is above a perfect balance of the same total (0: none)."""
        mean = sum(self.stage_costs) / len(self.stage_costs)
        return self.slowest / mean - 1.0


def stage_costs(layers: Sequence[int], layer_costs: Sequence[float], first_extra: float = 0.0,
                last_extra: float = 0.0) -> tuple[float, ...]:
    """Each stage's time: its layers' costs (in model order) plus the first and last stage's own."""
    costs, start = [], 0
    for s, n in enumerate(layers):
        cost = sum(layer_costs[start:start + n])
        cost += first_extra if s == 0 else 0.0
        cost += last_extra if s == len(layers) - 1 else 0.0
        costs.append(cost)
        start += n
    return tuple(costs)


def best_split(layer_costs: Sequence[float], stages: int, first_extra: float = 0.0,
               last_extra: float = 0.0, first_and_last_only: bool = False) -> Split:
    """The contiguous split of the layers (costs in model order) over `stages` stages, each with
    at least one layer, whose slowest stage is fastest; among those, the most even (least sum
    of squared stage times). `first_and_last_only`: only splits whose stages between the first
    and the last are equal, which Megatron's --decoder-first/last-pipeline-num-layers express
    (multi-token prediction under 2bw takes no pipeline layout)."""
    costs = list(map(float, layer_costs))
    total = len(costs)
    if stages < 1 or total < stages:
        raise ValueError(f"cannot split {total} layers over {stages} stages with at least one layer each")
    if first_and_last_only:
        candidates = [c for c in _first_and_last_splits(total, stages)]
    else:
        candidates = [_dynamic(costs, stages, first_extra, last_extra)]
    scored = [(_score(stage_costs(c, costs, first_extra, last_extra)), c) for c in candidates]
    _score_value, counts = min(scored)
    return Split(tuple(counts), stage_costs(counts, costs, first_extra, last_extra))


def _score(costs: Sequence[float]) -> tuple[float, float]:
    """Slowest first (rounded, so float noise does not order equal splits), then evenness."""
    return round(max(costs), 9), round(sum(c * c for c in costs), 9)


def _first_and_last_splits(total: int, stages: int):
    if stages == 1:
        yield (total,)
        return
    for first in range(1, total):
        for last in range(1, total - first + 1):
            rest, between = total - first - last, stages - 2
            if (between == 0 and rest == 0) or (between > 0 and rest >= between and rest % between == 0):
                yield (first,) + (rest // between,) * between + (last,) if between else (first, last)


def _dynamic(costs: list, stages: int, first_extra: float, last_extra: float) -> tuple[int, ...]:
    """Exact over every contiguous split: (slowest, sum of squares) minimised lexicographically."""
    total = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(s: int, start: int, end: int) -> float:
        extra = (first_extra if s == 0 else 0.0) + (last_extra if s == stages - 1 else 0.0)
        return prefix[end] - prefix[start] + extra

    @lru_cache(maxsize=None)
    def best(s: int, start: int) -> tuple[float, float, tuple[int, ...]]:
        """Stages s.. over layers start..: (slowest, sum of squares, counts)."""
        if s == stages - 1:
            c = cost(s, start, total)
            return round(c, 9), round(c * c, 9), (total - start,)
        found = None
        for end in range(start + 1, total - (stages - 1 - s) + 1):
            slowest, squares, counts = best(s + 1, end)
            c = cost(s, start, end)
            option = (max(round(c, 9), slowest), round(squares + c * c, 9), (end - start,) + counts)
            if found is None or option[:2] < found[:2]:
                found = option
        return found

    return best(0, 0)[2]


def even_split(num_layers: int, stages: int) -> tuple[int, ...]:
    """Megatron's own split when it divides evenly (else the first stages take one more)."""
    base, extra = divmod(num_layers, stages)
    return tuple(base + (1 if s < extra else 0) for s in range(stages))


def megatron_flags(layers: Sequence[int], mtp: bool = False) -> list[str]:
    """Megatron-LM's flags for this split: none for its own even split; the first and last
    stage's layer counts where the stages between are equal; else a pipeline layout (which
    Megatron does not combine with multi-token prediction under 2bw: ValueError)."""
    layers = list(layers)
    if len(set(layers)) == 1:
        return []
    middle = layers[1:-1]
    if len(set(middle)) <= 1:
        flags = []
        if len(layers) > 1 and (not middle or layers[0] != middle[0]):
            flags += ["--decoder-first-pipeline-num-layers", str(layers[0])]
        if len(layers) > 1 and (not middle or layers[-1] != middle[0]):
            flags += ["--decoder-last-pipeline-num-layers", str(layers[-1])]
        return flags
    if mtp:
        raise ValueError(f"the split {layers} needs --pipeline-model-parallel-layout, which 2bw does not combine "
                         "with --mtp-num-layers")
    stages = [f"t*{n}" for n in layers]
    stages[0] = "E" + stages[0]
    stages[-1] = stages[-1] + "L"
    return ["--pipeline-model-parallel-layout", "|".join(stages)]


def layers_per_stage(num_layers: int, stages: int, first: int | None = None, last: int | None = None,
                     layout: str | None = None) -> list[int]:
    """The transformer layers each stage holds under Megatron's flags (--pipeline-model-parallel-
    layout, read by Megatron's own parser; --decoder-first/last-pipeline-num-layers; else its
    even split), for plans made before any process group exists."""
    if layout:
        from megatron.core.transformer.enums import LayerType
        from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

        rows = PipelineParallelLayerLayout.parse_str_to_list(layout)
        if len(rows) != stages:
            raise ValueError(f"--pipeline-model-parallel-layout {layout!r} has {len(rows)} stages, not {stages} "
                             "(virtual stages are not planned)")
        return [sum(1 for kind in row if kind == LayerType.decoder) for row in rows]
    counts: list = [None] * stages
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    rest = [s for s in range(stages) if counts[s] is None]
    left = num_layers - sum(c for c in counts if c is not None)
    for s in rest:
        counts[s] = left // len(rest)
    return counts


def layer_flops_per_token(layer_params: int, hidden: int, seq_length: int) -> float:
    """Forward FLOPs a transformer layer spends on one token: 2 per weight it applies (the
    parameters of one layer, the routed experts' share for MoE) plus causal attention's
    scores and weighted sum, 2 x seq x hidden."""
    return 2.0 * layer_params + 2.0 * seq_length * hidden


def cost_model(args, active_layer_params: int) -> tuple[float, float]:
    """(a layer's, the last stage's own) forward FLOPs a token (backward is twice as much
    everywhere, so the ratios are the same): the output layer and loss (2 x hidden x
    vocabulary), with each multi-token-prediction layer and its own output layer; the
    embedding's lookup is free."""
    layer = layer_flops_per_token(active_layer_params, args.hidden_size, args.seq_length)
    head = 2.0 * args.hidden_size * args.padded_vocab_size
    return layer, head + (args.mtp_num_layers or 0) * (layer + head)


def planned_split(args, active_layer_params: int) -> Split:
    """The best split of this run's layers over its pipeline stages under `cost_model`."""
    layer, last_extra = cost_model(args, active_layer_params)
    return best_split([layer] * args.num_layers, args.pipeline_model_parallel_size, last_extra=last_extra,
                      first_and_last_only=bool(args.mtp_num_layers))

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
    # compared in units of the mean layer, so the rounding that makes equal splits tie (float
    # noise) is relative: costs in seconds (1e-6) would otherwise all round to one value
    unit = sum(costs) / total or 1.0
    scaled, first, last = [c / unit for c in costs], first_extra / unit, last_extra / unit
    if first_and_last_only:
        candidates = [c for c in _first_and_last_splits(total, stages)]
    else:
        candidates = [_dynamic(scaled, stages, first, last)]
    scored = [(_score(stage_costs(c, scaled, first, last)), c) for c in candidates]
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


@dataclass(frozen=True)
class LayerShape:
    """One transformer layer as the planner built it (tensor parallelism 1): the parameters a
    token goes through, and every weight matrix as (rows, columns, is an expert's)."""
    active_params: int
    matrices: tuple[tuple[int, int, bool], ...]
    params: int  # all of the layer's parameters (every expert's)
    expert_params: int


@dataclass(frozen=True)
class CostModel:
    """Seconds a stage spends per microbatch on the reference cluster (planning/hardware.py):
    each layer's forward and backward plus its share of the optimizer step (amortised over
    the batch's m microbatches), and what only the first and the last stage hold."""
    layer: float
    first_extra: float
    last_extra: float
    num_layers: int
    terms: dict  # each term in seconds a microbatch, for the plan's report

    def stage_costs(self, layers: Sequence[int]) -> tuple[float, ...]:
        return stage_costs(layers, [self.layer] * sum(layers), self.first_extra, self.last_extra)

    def best(self, stages: int, first_and_last_only: bool = False) -> Split:
        return best_split([self.layer] * self.num_layers, stages, self.first_extra, self.last_extra,
                          first_and_last_only)


def cost_model(args, layer: LayerShape, cluster=None) -> CostModel:
    """The run's costs from its shape and flags:
    - passes: forward FLOPs (`layer_flops_per_token`; the output layer and loss 2 x hidden x
      vocabulary a token; each multi-token-prediction layer with its own output layer),
      backward twice that, at the cluster's pass rate; the embedding's lookup is free; an
      MoE layer's expert all-to-all (dispatch and combine, both passes) over NVLink;
    - the optimizer step, once a batch: every local parameter's state through HBM, Muon's
      Newton-Schulz on each weight matrix, the distributed optimizer's reduce-scatter and
      all-gather over the data-parallel ranks (NVLink); experts shared over all of a stage's
      GPUs; the embedding's step on the first stage, an untied output layer's on the last;
    - with tied embeddings at PP > 1, the link's two transfers a step between the first and
      the last stage (fp32 gradient one way, bf16 weights back) over the inter-node link."""
    from megatron_async.planning.hardware import ADAM_STEP_BYTES, H100, newton_schulz_flops

    c = cluster or H100
    h, vocab, tp = args.hidden_size, args.padded_vocab_size, args.tensor_model_parallel_size
    dp = args.data_parallel_size
    tokens = args.micro_batch_size * args.seq_length
    m = max(args.global_batch_size // (args.micro_batch_size * dp), 1)
    layer_pass = 3 * layer_flops_per_token(layer.active_params, h, args.seq_length) * tokens / tp / c.pass_flops_s
    ep = args.expert_model_parallel_size
    if args.num_experts and ep > 1:  # dispatch and combine, forward and backward, not overlapped
        routed = 2.0 * tokens * args.moe_router_topk * h * (ep - 1) / ep  # bf16 bytes leaving this GPU
        layer_pass += 2 * 2 * (routed / c.nvlink_bytes_s + c.link_latency_s)
    head_pass = 3 * 2.0 * h * vocab * tokens / tp / c.pass_flops_s
    stage_gpus = dp * tp  # experts are spread over all of them (expert parallel x expert data parallel)
    dense = layer.params - layer.expert_params
    step = ADAM_STEP_BYTES * (dense / (dp * tp) + layer.expert_params / stage_gpus) / c.hbm_bytes_s
    if "muon" in args.optimizer:
        ns_dense = sum(newton_schulz_flops(r, k) for r, k, expert in layer.matrices if not expert)
        ns_expert = sum(newton_schulz_flops(r, k) for r, k, expert in layer.matrices if expert)
        step += (ns_dense / dp + ns_expert / stage_gpus) / (c.peak_flops * c.ns_mfu)
    step += _data_parallel_exchange(2.0 * dense / tp, dp, c)
    layer_step = step / m
    table_step = (ADAM_STEP_BYTES * vocab * h / (dp * tp) / c.hbm_bytes_s
                  + _data_parallel_exchange(2.0 * vocab * h / tp, dp, c)) / m
    tied = not args.untie_embeddings_and_output_weights
    link = 0.0
    if tied and args.pipeline_model_parallel_size > 1:
        link = ((4 + 2) * vocab * h / tp / c.ib_bytes_s + 2 * c.link_latency_s) / m
    mtp = (args.mtp_num_layers or 0) * (layer_pass + layer_step + head_pass)
    terms = {"layer_pass": layer_pass, "layer_step": layer_step, "output_layer_and_loss": head_pass,
             "embedding_step": table_step, "output_layer_step": 0.0 if tied else table_step,
             "tied_link": link, "mtp_layers": mtp}
    first = table_step + link
    last = head_pass + mtp + link + (0.0 if tied else table_step)
    return CostModel(layer_pass + layer_step, first, last, args.num_layers, terms)


def _data_parallel_exchange(grad_bytes: float, dp: int, cluster) -> float:
    """The distributed optimizer's reduce-scatter of gradients and all-gather of parameters
    (bf16, `grad_bytes` each) over `dp` ranks on NVLink, ring algorithm."""
    if dp <= 1:
        return 0.0
    return 2 * (dp - 1) / dp * grad_bytes / cluster.nvlink_bytes_s

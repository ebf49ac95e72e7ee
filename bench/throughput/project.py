"""Cost model: what 1F1B, interleaved 1F1B and 2BW give on a GPU cluster.

A schedule's throughput is set by what each stage's passes cost and what waits
between them; the simulator (`megatron_async.schedules.simulator`) computes the
waits from the same action lists the runtime uses. This module supplies the costs:

- compute: FLOPs per pass of each stage (transformer layers, embedding, output
  layer) at a stated model FLOP utilisation (MFU) of the GPU's peak;
- point-to-point: one activation (micro-batch x sequence x hidden, bf16) over the
  link between two stages, plus a latency;
- MoE: each MoE layer's all-to-all dispatch and combine over the expert-parallel
  group, forward and backward, not overlapped with compute;
- optimizer: the distributed optimizer's reduce-scatter of gradients and
  all-gather of parameters over the data-parallel group, the update's memory
  traffic (Adam) and Muon's Newton-Schulz FLOPs, spread over the data-parallel
  ranks by the layer-wise distributed optimizer;
- 1F1B's global gradient-norm all-reduce across stages at each step (2BW clips per
  stage and has none);
- the host: a layer's pass takes the longer of its GPU time and the time the host needs
  to issue its operators (the operators a layer dispatches, counted by
  bench/throughput/host_time.py, at a stated host time each), unless CUDA graphs replay it.

Megatron's overlaps are priced against 2BW with and without them (`overlap_rows`, `--overlaps`):
Megatron's interleaved 1F1B with the EP all-to-all overlap of its combined forward-backward
step (`--overlap-moe-expert-parallel-comm`, which Megatron runs only with virtual stages at
PP > 1, and 2BW's runtime on its own combined-step lists), and 1F1B and interleaved 1F1B with
CUDA graphs (`--cuda-graph-impl`, which 2BW refuses). The EP overlap is simulated on each
schedule's own lists with combined steps (2bw's with the deeper warm-up of
schedules/gen_2bw_paired.py), each step priced at what it costs (`StageCosts.pair`).

Validation on CPU: `predict_cpu` turns per-stage costs measured on this machine
(bench/throughput/stage_costs.py) into the s / microbatch of each configuration of
bench/throughput/pipeline_throughput.py, which reports both side by side.

    .venv/bin/python -m bench.throughput.project --json out/bench/project.json --plot docs/img/projection_10b_moe.png

prints the projection for the 10B MoE (examples/moe_10b/flags.sh) on 8-GPU H100
nodes at PP = 4, 8, 16 and m = p, 2p, 4p; every assumption is in ASSUMPTIONS.

    .venv/bin/python -m bench.throughput.project --overlaps [--model smollm-360m] [--host-us-per-op 30]

prints the overlaps' table instead (each schedule at its faster split).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from megatron_async.planning.hardware import ASSUMPTIONS as HARDWARE_ASSUMPTIONS
from megatron_async.planning.balance import best_split
from megatron_async.planning.hardware import H100, Cluster, newton_schulz_flops
from megatron_async.schedules.generators import generate, min_microbatches_2bw_paired
from megatron_async.schedules.simulator import simulate

SIM_BATCHES = 6  # batches per simulated run; the simulator's rate uses the middle ones


@dataclass(frozen=True)
class Model:
    """A GPT's shape; MoE when experts > 0 (every layer MoE, SwiGLU experts)."""
    layers: int = 24
    hidden: int = 2048
    heads: int = 16
    seq: int = 4096
    vocab: int = 50304
    ffn: int = 0  # dense MLP width (0: no dense MLP)
    swiglu: bool = True
    experts: int = 64
    expert_ffn: int = 1024
    topk: int = 8
    kv_heads: int = 0  # grouped-query attention's key/value heads (0: as many as heads)
    tied: bool = False  # tied input and output embeddings: one table, the link between the ends

    def attention_projection_params(self) -> int:
        """Q and output projections (h x h each), K and V (h x kv_heads x head dim each)."""
        h, kv = self.hidden, self.kv_heads or self.heads
        return 2 * h * h + 2 * h * (h // self.heads) * kv


MOE_10B = Model()  # examples/moe_10b/flags.sh: OLMoE-1B-7B's layer x 24
# examples/smollm_360m/flags.sh: SmolLM-360M's published shape (dense SwiGLU, GQA 15/5, tied embeddings)
SMOLLM_360M = Model(layers=32, hidden=960, heads=15, kv_heads=5, seq=2048, vocab=49152, ffn=2560, experts=0,
                    tied=True)
# (model, stage counts, data-parallel size, micro-batch, the configuration's own m) per --model
LAYOUTS = {"moe-10b": (MOE_10B, (4, 8, 16), 8, 1, 64), "smollm-360m": (SMOLLM_360M, (4, 8), 2, 8, 16)}


# aten operators one layer's forward and backward dispatch in Megatron-Core's local layers,
# counted by bench/throughput/host_time.py (docs/benchmarks.md): (forward, backward)
LAYER_OPERATORS = {"moe": (261, 350), "dense": (104, 139)}
HOST_S_PER_OP = 5e-6  # stated: see ASSUMPTIONS["host"]

ASSUMPTIONS = {
    **HARDWARE_ASSUMPTIONS,
    "host": "a layer's pass takes max(GPU time, operators x host time per operator) without CUDA graphs, "
            "its GPU time with them (graphs remove all host time: favours the schedules with graphs); "
            "operators a layer dispatches: Megatron's local layers, counted by bench/throughput/host_time.py "
            "(261 forward, 350 backward for the MoE layer, 104 and 139 for the dense one; Transformer "
            "Engine's fused layers dispatch fewer); host time per operator: 5 us, stated (a bare PyTorch "
            "operator takes 4 us of host time on this project's CPU, bench/throughput/host_time.py; a CUDA "
            "launch and Megatron's Python around it add to it), --host-us-per-op changes it",
    "ep_overlap": "Megatron's combined forward-backward step runs one microbatch's forward beside another's "
                  "backward and hides each pass's all-to-all (dispatch and combine) behind the other pass's "
                  "compute, as far as that compute lasts; the overlap itself is free (SM sharing and "
                  "--delay-wgrad-compute's split left out: favours the overlapped schedule). Where the steps "
                  "run is simulated, not assumed: the lists with --overlap-moe-expert-parallel-comm, interleaved "
                  "1F1B with Megatron's one extra warm-up forward (get_pp_rank_microbatches) and combined steps "
                  "in its steady state, 2bw with a warm-up of 2(p-1-s)+1 forwards and combined steps "
                  "(schedules/gen_2bw_paired.py, m >= 2p-1); a combined step sends its activation and its "
                  "gradient only when it ends; Megatron-Core 0.19.2 runs the overlap only with virtual stages "
                  "at PP > 1 (TransformerConfig), so plain 1F1B has none",
    "layout": "DP=8 per stage on one node (EP=8 over it, TP=1), stages on different nodes: "
              "pipeline p2p crosses InfiniBand, DP and EP traffic stays on NVLink",
    "flops": "forward 2 FLOPs per multiply-add of every GEMM (QKV, attention scores and values with a "
             "causal half, projection, router, top-k experts, output layer); backward 2x forward, split "
             "evenly into input and weight gradients",
    "optimizer": "Adam: 16 bytes of optimizer state + 4 of gradient + 2 of parameter per parameter, read "
                 "and written once, divided over DP ranks; Muon: 5 Newton-Schulz iterations of "
                 "4mn^2+2m^3 FLOPs for an m x n matrix (m <= n), layer-wise over DP ranks; distributed "
                 "optimizer: reduce-scatter of bf16 gradients and all-gather of bf16 parameters of the "
                 "non-expert parameters over DP (experts are EP-sharded, expert DP = 1)",
}


def layer_flops(model: Model, tokens: int) -> float:
    """Forward FLOPs of one transformer layer for `tokens` tokens (sequence model.seq)."""
    h = model.hidden
    attention = 2 * tokens * model.attention_projection_params() + 2 * 2 * tokens * model.seq * h / 2  # + causal scores
    if model.experts:
        mlp = 2 * tokens * model.topk * (3 if model.swiglu else 2) * h * model.expert_ffn
        mlp += 2 * tokens * h * model.experts  # router
    else:
        mlp = 2 * tokens * (3 if model.swiglu else 2) * h * model.ffn
    return attention + mlp


def layer_params(model: Model) -> tuple[int, int]:
    """(non-expert, expert) parameters of one layer."""
    h = model.hidden
    dense = model.attention_projection_params() + (model.experts * h if model.experts else (3 if model.swiglu else 2) * h * model.ffn)
    experts = model.experts * (3 if model.swiglu else 2) * h * model.expert_ffn
    return dense, experts


def split_layers(layers: int, stages: int) -> list[int]:
    """As even as whole layers allow; the extra layers go to the middle stages, away from
    the embedding and the output layer (what --pipeline-model-parallel-layout can express)."""
    base, extra = divmod(layers, stages)
    order = sorted(range(stages), key=lambda s: (s in (0, stages - 1), abs(s - (stages - 1) / 2)))
    counts = [base] * stages
    for s in order[:extra]:
        counts[s] += 1
    return counts


@dataclass
class StageCosts:
    fwd: list[float]
    bwd: list[float]
    opt: list[float]
    p2p: float
    sync: float  # 1F1B's cross-stage gradient-norm all-reduce per step
    pair: list[float] | None = None  # a combined forward-backward step (None: forward + backward)
    detail: dict = field(default_factory=dict)


def gpu_costs(model: Model, cluster: Cluster, pp: int, dp: int = 8, ep: int = 8, mbs: int = 1,
              optimizer: str = "muon", counts=None, m: int = 0, host_s_per_op: float = HOST_S_PER_OP,
              graphs: bool = False) -> StageCosts:
    """Per-stage seconds of one microbatch's forward and backward, of one combined step (a
    forward beside another microbatch's backward, Megatron's EP overlap) and of one optimizer
    step, for the layers per stage `counts` (default: the best split for m microbatches a
    batch, `balanced_counts`). A layer's pass takes the longer of its GPU time and its host
    time (none with `graphs`)."""
    tokens = mbs * model.seq
    rate = cluster.peak_flops * cluster.mfu
    act_bytes = 2 * tokens * model.hidden
    a2a = 0.0
    if model.experts:  # dispatch + combine, (ep-1)/ep of the routed tokens leave the GPU
        routed = 2 * tokens * model.topk * model.hidden * (ep - 1) / ep
        a2a = 2 * (routed / cluster.nvlink_bytes_s + cluster.link_latency_s)
    compute_f = layer_flops(model, tokens) / rate
    compute_b = 2 * compute_f
    ops_f, ops_b = LAYER_OPERATORS["moe" if model.experts else "dense"]
    host_f, host_b = (0.0, 0.0) if graphs else (ops_f * host_s_per_op, ops_b * host_s_per_op)

    layer_f, layer_b = max(compute_f + a2a, host_f), max(compute_b + a2a, host_b)
    # a layer's combined step: the forward's all-to-all hides behind the backward's compute and
    # the other way round, as far as that compute lasts; the host issues both passes' operators
    hidden = min(a2a, compute_b) + min(a2a, compute_f)
    layer_pair = max(compute_f + compute_b + 2 * a2a - hidden, host_f + host_b)
    head = 2 * tokens * model.hidden * model.vocab / rate
    dense, experts = layer_params(model)
    table = model.vocab * model.hidden

    def step(layers: int, tables: int) -> float:
        stage_dense = layers * dense + tables * table
        ring = (dp - 1) / dp * 2 * stage_dense  # bf16 bytes each way
        comm = 2 * ring / cluster.nvlink_bytes_s  # reduce-scatter + all-gather
        update = 22 * (stage_dense / dp + layers * experts / ep) / cluster.hbm_bytes_s
        if optimizer == "muon":
            h = model.hidden
            mats = [(3 * h, h), (h, h)] + ([(2 * model.expert_ffn, h), (h, model.expert_ffn)] * model.experts)
            update += layers * sum(newton_schulz_flops(r, c) for r, c in mats) / dp / (cluster.peak_flops * cluster.ns_mfu)
        return comm + update

    link = (4 + 2) * table / cluster.ib_bytes_s + 2 * cluster.link_latency_s if model.tied and pp > 1 else 0.0
    last_tables = 0 if model.tied else 1
    if counts is None:
        counts = balanced_counts(model.layers, pp, layer_f + layer_b + step(1, 0) / max(m, 1),
                                 (step(0, 1) + link) / max(m, 1), 3 * head + (step(0, last_tables) + link) / max(m, 1))
    fwd, bwd, pair, opt = [], [], [], []
    for s, n in enumerate(counts):
        f, b, fb = n * layer_f, n * layer_b, n * layer_pair
        tables = (1 if s == 0 else 0) + (last_tables if s == pp - 1 else 0)
        if s == pp - 1:  # the output layer's passes hide nothing
            f, b, fb = f + head, b + 2 * head, fb + 3 * head
        fwd.append(f)
        bwd.append(b)
        pair.append(fb)
        opt.append(step(n, tables) + (link if s in (0, pp - 1) else 0.0))
    p2p = act_bytes / cluster.ib_bytes_s + cluster.link_latency_s
    sync = 2 * math.log2(max(pp, 2)) * cluster.link_latency_s
    return StageCosts(fwd, bwd, opt, p2p, sync, pair=pair, detail={
        "layers_per_stage": list(counts), "a2a_per_layer_pass": a2a, "compute_per_layer": [compute_f, compute_b],
        "host_per_layer": [host_f, host_b], "combined_step_per_layer": layer_pair})


def balanced_counts(layers: int, pp: int, layer: float, first_extra: float, last_extra: float) -> list[int]:
    """The planner's split (megatron_async.planning.balance.best_split) for these per-microbatch costs."""
    return list(best_split([layer] * layers, pp, first_extra, last_extra).layers)


@functools.lru_cache(maxsize=None)
def _action_lists(schedule: str, pp: int, m: int, ep_overlap: bool = False):
    """A schedule's action lists, generated once per shape: a projection simulates each shape
    under several models and layouts, and the simulator only reads them."""
    return generate(schedule, pp, m, SIM_BATCHES, ep_overlap=ep_overlap)


def simulate_config(schedule: str, pp: int, m: int, costs: StageCosts, chunks: int = 2,
                    ep_overlap: bool = False) -> float:
    """Seconds per microbatch (steady state) of `schedule` under `costs`; with `ep_overlap`, of
    the lists it runs with --overlap-moe-expert-parallel-comm, each combined step at `costs.pair`."""
    f, b, fb = costs.fwd, costs.bwd, costs.pair
    if schedule == "interleaved-1f1b":  # each piece holds half a stage
        f, b = [x / chunks for x in f], [x / chunks for x in b]
        fb = fb and [x / chunks for x in fb]
    result = simulate(_action_lists(schedule, pp, m, ep_overlap), fwd=f, bwd=b, pair=fb, opt=costs.opt,
                      p2p=costs.p2p, sync_at_step=schedule != "2bw", sync_cost=costs.sync)
    return 1.0 / result.throughput


def predict_cpu(stages: dict, configs: list[tuple]) -> dict[str, float]:
    """s / microbatch of bench/throughput/pipeline_throughput.py's configurations from costs measured on
    this machine (bench/throughput/stage_costs.py): PP=1 is forward + backward + step / m; PP=2 runs the
    simulator on the schedule's action lists (1F1B and interleaved with the step collective)."""
    one = stages["pp1"][0]
    two = stages.get("pp2")
    costs = two and StageCosts([s["fwd"] for s in two], [s["bwd"] for s in two], [s["opt"] for s in two],
                               p2p=two[0].get("p2p", 0.0), sync=0.0)
    out = {}
    for name, pp, m, extra in configs:
        if pp == 1:
            out[name] = one["fwd"] + one["bwd"] + one["opt"] / m
            continue
        if not costs or {"--pipeline-model-parallel-layout", "--decoder-first-pipeline-num-layers",
                         "--account-for-loss-in-pipeline-split"} & set(extra):
            continue  # uneven layouts: the measured stage costs are for the even split
        schedule = ("2bw" if "2bw" in extra else
                    "interleaved-1f1b" if "--num-virtual-stages-per-pipeline-rank" in extra else "1f1b")
        out[name] = simulate_config(schedule, pp, m, costs)
    return out


CONFIGURED_M = 64  # examples/moe_10b/flags.sh: global batch 512 / (micro-batch 1 x DP 8)


def project(model: Model, cluster: Cluster, pps=(4, 8, 16), dp: int = 8, mbs: int = 1,
            optimizer: str = "muon", configured_m: int = CONFIGURED_M,
            host_s_per_op: float = HOST_S_PER_OP) -> list[dict]:
    """Tokens/s per GPU and efficiency for each (schedule, p, m, layout), m = p, 2p, 4p and the
    configuration's own m: each schedule at Megatron's even split ("even", the extra layers
    in the middle) and at the planner's split for its costs ("balanced"; interleaved 1F1B
    balances each rank's total, its two pieces halves of it)."""
    rows = []
    for pp in pps:
        for m in sorted({pp, 2 * pp, 4 * pp, configured_m}):
            layouts = {"even": gpu_costs(model, cluster, pp, dp=dp, mbs=mbs, optimizer=optimizer,
                                         counts=split_layers(model.layers, pp), host_s_per_op=host_s_per_op),
                       "balanced": gpu_costs(model, cluster, pp, dp=dp, mbs=mbs, optimizer=optimizer, m=m,
                                             host_s_per_op=host_s_per_op)}
            for layout, costs in layouts.items():
                ideal = (sum(costs.fwd) + sum(costs.bwd)) / pp  # perfectly balanced, no bubble, free step
                for schedule in ("1f1b", "interleaved-1f1b", "2bw"):
                    row = dict(schedule=schedule, pp=pp, m=m, layout=layout,
                               layers_per_stage=costs.detail["layers_per_stage"])
                    if schedule == "interleaved-1f1b" and min(costs.detail["layers_per_stage"]) < 2:
                        rows.append(dict(row, note="needs 2 layers per stage"))
                        continue
                    t = simulate_config(schedule, pp, m, costs)
                    rows.append(dict(row, gpus=pp * dp, s_per_microbatch=t, tokens_per_s_per_gpu=mbs * model.seq / t / pp,
                                     efficiency=ideal / t))
    return rows


# Megatron's schedules with their overlaps: schedule row name -> (Megatron's schedule, EP all-to-all overlap,
# CUDA graphs, a split finer than whole layers)
OVERLAPPED = {
    "1f1b+cuda-graphs": ("1f1b", False, True, False),
    "interleaved-1f1b+cuda-graphs": ("interleaved-1f1b", False, True, False),
    "interleaved-1f1b+ep-overlap": ("interleaved-1f1b", True, False, False),
    "interleaved-1f1b+ep-overlap+cuda-graphs": ("interleaved-1f1b", True, True, False),
}
# the same overlaps under 2BW (the EP overlap on its combined-step lists, which its runtime trains;
# CUDA graphs captured per weight version, not implemented), and the EP overlap on a split finer than
# whole layers (`finer_split`, not implemented): what would win back a lead it loses
WIN_BACK = {
    "2bw+ep-overlap": ("2bw", True, False, False),
    "2bw+cuda-graphs": ("2bw", False, True, False),
    "2bw+ep-overlap+cuda-graphs": ("2bw", True, True, False),
    "2bw+ep-overlap+finer-split": ("2bw", True, False, True),
}
IMPLEMENTED = (*OVERLAPPED, "2bw+ep-overlap")  # rows a runtime trains (Megatron's or ours)
NO_EP_OVERLAP_WITHOUT_VIRTUAL_STAGES = ("Megatron-Core 0.19.2 runs --overlap-moe-expert-parallel-comm only with "
                                        "virtual stages at PP > 1")


def finer_split(costs: StageCosts) -> StageCosts:
    """Every stage at the mean of `costs`' stages: the model's time split evenly, which a split
    finer than whole layers (parts of a layer, the output layer's work moved) approaches."""
    def mean(xs):
        return None if xs is None else [sum(xs) / len(xs)] * len(xs)

    return replace(costs, fwd=mean(costs.fwd), bwd=mean(costs.bwd), pair=mean(costs.pair), opt=mean(costs.opt))


def ep_overlap_refusal(schedule: str, pp: int, m: int) -> str | None:
    """Why `schedule` has no lists with the EP overlap at (p, m), None if it has: 2bw's combined
    steps need m >= 2p-1 (schedules/gen_2bw_paired.py)."""
    if schedule == "2bw" and m < min_microbatches_2bw_paired(pp):
        return f"needs m >= 2p-1 = {min_microbatches_2bw_paired(pp)}"
    return None


def overlap_rows(model: Model, cluster: Cluster, pps=(4, 8, 16), dp: int = 8, mbs: int = 1,
                 optimizer: str = "muon", configured_m: int = CONFIGURED_M,
                 host_s_per_op: float = HOST_S_PER_OP) -> list[dict]:
    """`project`'s rows, then for each of its Megatron rows the same schedule at the same
    split with Megatron's overlaps (OVERLAPPED; the EP overlap for MoE models only),
    and for its 2BW rows the same overlaps under 2BW (WIN_BACK; `implemented`: the EP overlap alone):
    tokens/s per GPU and `over_base`, the speed-up over the schedule without them. With the
    EP overlap a schedule runs its lists with combined steps (`simulate_config`); 2BW's need
    m >= 2p-1, and below that its row carries a note instead."""
    rows = project(model, cluster, pps=pps, dp=dp, mbs=mbs, optimizer=optimizer, configured_m=configured_m,
                   host_s_per_op=host_s_per_op)
    out = list(rows)
    for base in rows:
        variants = [(name, *how) for name, how in {**OVERLAPPED, **WIN_BACK}.items()
                    if how[0] == base["schedule"] and (model.experts or not how[1])]
        if model.experts and base["schedule"] == "1f1b":
            out.append(dict(schedule="1f1b+ep-overlap", pp=base["pp"], m=base["m"], layout=base["layout"],
                            layers_per_stage=base["layers_per_stage"], note=NO_EP_OVERLAP_WITHOUT_VIRTUAL_STAGES))
        for name, schedule, ep_overlap, graphs, finer in variants:
            row = dict(schedule=name, base=schedule, pp=base["pp"], m=base["m"], layout=base["layout"],
                       layers_per_stage=base["layers_per_stage"], implemented=name in IMPLEMENTED)
            pp, m = base["pp"], base["m"]
            refusal = ep_overlap and ep_overlap_refusal(schedule, pp, m)
            if "efficiency" not in base or refusal:
                out.append(dict(row, note=refusal or base["note"]))
                continue
            costs = gpu_costs(model, cluster, pp, dp=dp, mbs=mbs, optimizer=optimizer,
                              counts=base["layers_per_stage"], host_s_per_op=host_s_per_op, graphs=graphs)
            t = simulate_config(schedule, pp, m, finer_split(costs) if finer else costs, ep_overlap=ep_overlap)
            out.append(dict(row, gpus=pp * dp, s_per_microbatch=t, tokens_per_s_per_gpu=mbs * model.seq / t / pp,
                            over_base=base["s_per_microbatch"] / t))
    return out


def fastest(rows: list[dict], schedule: str, pp: int, m: int) -> dict | None:
    """The schedule's row at (p, m) at its faster split, None if it has no timed row there."""
    timed = [r for r in rows if (r["schedule"], r["pp"], r["m"]) == (schedule, pp, m) and "tokens_per_s_per_gpu" in r]
    return max(timed, key=lambda r: r["tokens_per_s_per_gpu"]) if timed else None


def overlap_report(rows: list[dict]) -> str:
    """2BW without the overlaps against Megatron's schedules with them, each at
    its faster split (tokens/s per GPU), 2BW over the fastest of them; for an MoE, 2BW with
    the EP overlap (its combined-step lists, which its runtime trains) over the same;
    and where 2BW's lead is below 1, each of the same overlaps under 2BW (the EP overlap, and
    those not implemented) that wins it back, or "none of them"."""
    moe = any(r["schedule"].startswith("interleaved-1f1b+ep-overlap") for r in rows)
    names = ["1f1b", "1f1b+cuda-graphs", "interleaved-1f1b", "interleaved-1f1b+cuda-graphs"]
    names += ["interleaved-1f1b+ep-overlap", "interleaved-1f1b+ep-overlap+cuda-graphs"] if moe else []
    back = [name for name, how in WIN_BACK.items() if moe or not how[1]]
    paired = ["2bw+ep-overlap", "2bw+ep-overlap / the fastest"] if moe else []
    header = ["p", "m", "2bw", *names, "the fastest", "2bw / the fastest", *paired,
              "what wins it back (not implemented)"]
    lines = ["| " + " | ".join(header) + " |", "| --- " * len(header) + "|"]
    for pp, m in sorted({(r["pp"], r["m"]) for r in rows}):
        two = fastest(rows, "2bw", pp, m)
        found = {name: fastest(rows, name, pp, m) for name in names}
        best = max((r for r in found.values() if r), key=lambda r: r["tokens_per_s_per_gpu"])
        over = lambda r: r["tokens_per_s_per_gpu"] / best["tokens_per_s_per_gpu"]  # noqa: E731
        wins = ""
        if over(two) < 1:
            win = [r for r in (fastest(rows, name, pp, m) for name in back) if r and over(r) >= 1]
            wins = "; ".join(f"{r['schedule']}: {over(r):.2f}x" for r in win) or "none of them"
        cells = [f"{r['tokens_per_s_per_gpu']:.0f}" if r else "n/a" for r in found.values()]
        if moe:
            with_overlap = fastest(rows, "2bw+ep-overlap", pp, m)
            note = next((r["note"] for r in rows if (r["schedule"], r["pp"], r["m"]) == ("2bw+ep-overlap", pp, m)
                         and "note" in r), "n/a")
            cells += [best["schedule"], f"{over(two):.2f}x",
                      f"{with_overlap['tokens_per_s_per_gpu']:.0f}" if with_overlap else note,
                      f"{over(with_overlap):.2f}x" if with_overlap else "n/a"]
        else:
            cells += [best["schedule"], f"{over(two):.2f}x"]
        lines.append(f"| {pp} | {m} | {two['tokens_per_s_per_gpu']:.0f} | " + " | ".join(cells) + f" | {wins} |")
    return "\n".join(lines)


def zbv_region(fwd: float, bwd: float, opt: float, p2p: float, split_overhead: float,
               pps=(2, 3, 4, 6, 8, 12, 16)) -> list[dict]:
    """2BW against ZB-V for p stages and m = p..4p, on a model whose whole forward,
    backward and optimizer step cost `fwd`, `bwd`, `opt` (measured at PP=1), split
    evenly over the stages (balanced: the output layer's extra work is left out for
    both). ZB-V's split backward costs (1 + split_overhead) x the plain one, its two
    halves equal; it flushes with a step collective, 2BW steps per stage."""
    rows = []
    for pp in pps:
        f, b, o = fwd / pp, bwd / pp, opt / pp
        costs = StageCosts([f] * pp, [b] * pp, [o] * pp, p2p=p2p, sync=0.0)
        for m in sorted({pp, 2 * pp - 1, 2 * pp, 3 * pp, 4 * pp}):
            two = 1.0 / simulate(generate("2bw", pp, m, SIM_BATCHES), fwd=costs.fwd, bwd=costs.bwd,
                                 opt=costs.opt, p2p=p2p).throughput
            half = b * (1 + split_overhead) / 4  # per piece (two per stage), per half
            zbv = 1.0 / simulate(generate("zbv", pp, m, SIM_BATCHES), fwd=f / 2, bwd=2 * half, bwd_input=half,
                                 bwd_weight=half, opt=o, p2p=p2p, sync_at_step=True).throughput
            ideal = (fwd + bwd + opt / m) / pp
            rows.append(dict(pp=pp, m=m, two_bw=two, zbv=zbv, speedup=zbv / two,
                             two_bw_efficiency=ideal / two, zbv_efficiency=ideal / zbv))
    return rows


def region_report(rows: list[dict]) -> str:
    lines = ["| p | m | 2BW efficiency | ZB-V efficiency | 2BW speed-up over ZB-V |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['pp']} | {r['m']} | {100 * r['two_bw_efficiency']:.1f}% | "
                     f"{100 * r['zbv_efficiency']:.1f}% | {r['speedup']:.3f}x |")
    return "\n".join(lines)


def best_layout(rows: list[dict], schedule: str, pp: int, m: int) -> dict:
    """The schedule's faster layout at (p, m): the planner balances each stage's time, which
    the simulated pipeline (its point-to-point and its step) can still order otherwise."""
    found = [r for r in rows if (r["schedule"], r["pp"], r["m"]) == (schedule, pp, m)]
    timed = [r for r in found if "efficiency" in r]
    return max(timed, key=lambda r: r["tokens_per_s_per_gpu"]) if timed else found[0]


def report(rows: list[dict]) -> str:
    """Each schedule at its best layout, and 2BW at the even split before it."""
    lines = ["| p | m | GPUs | 1F1B tok/s/GPU | interleaved | 2BW, even split | 2BW | 2BW / 1F1B | 2BW / interleaved "
             "| 2BW's split |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    by = {(r["schedule"], r["pp"], r["m"], r["layout"]): r for r in rows}
    for pp, m in sorted({(r["pp"], r["m"]) for r in rows}):
        one, il, two = (best_layout(rows, s, pp, m) for s in ("1f1b", "interleaved-1f1b", "2bw"))
        even = by[("2bw", pp, m, "even")]
        tok = lambda r: f"{r['tokens_per_s_per_gpu']:.0f} ({100 * r['efficiency']:.0f}%)" if "efficiency" in r else "n/a"
        ratio = lambda a, b: f"{a['tokens_per_s_per_gpu'] / b['tokens_per_s_per_gpu']:.2f}x" if "efficiency" in b else "n/a"
        lines.append(f"| {pp} | {m} | {one['gpus']} | {tok(one)} | {tok(il)} | {tok(even)} | {tok(two)} "
                     f"| {ratio(two, one)} | {ratio(two, il)} | {'/'.join(map(str, two['layers_per_stage']))} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pps = sorted({r["pp"] for r in rows})
    fig, axes = plt.subplots(1, len(pps), figsize=(4 * len(pps), 3.4), sharey=True)
    for ax, pp in zip(axes, pps):
        for schedule, colour in (("1f1b", "#4c78a8"), ("interleaved-1f1b", "#72b7b2"), ("2bw", "#f58518")):
            best = [best_layout(rows, schedule, pp, m) for m in sorted({r["m"] for r in rows if r["pp"] == pp})]
            pts = [(r["m"], r["tokens_per_s_per_gpu"]) for r in best if "efficiency" in r]
            if pts:
                ax.plot(*zip(*pts), marker="o", color=colour, label=schedule)
        ax.set_title(f"PP={pp}, DP=8 ({pp * 8} GPUs)")
        ax.set_xlabel("microbatches per batch m")
        ax.set_xscale("log", base=2)
    axes[0].set_ylabel("tokens / s / GPU (projected)")
    axes[0].legend(fontsize=8)
    fig.suptitle("10B MoE on H100 nodes: cost model + simulator (bench/throughput/project.py)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mfu", type=float, default=H100.mfu)
    ap.add_argument("--optimizer", choices=("muon", "adam"), default="muon")
    ap.add_argument("--model", choices=tuple(LAYOUTS), default="moe-10b",
                    help="moe-10b: examples/moe_10b, DP=8 a stage; smollm-360m: examples/smollm_360m, DP=2 a stage")
    ap.add_argument("--host-us-per-op", type=float, default=HOST_S_PER_OP * 1e6,
                    help="host time per operator a layer dispatches, in microseconds (ASSUMPTIONS['host'])")
    ap.add_argument("--overlaps", action="store_true",
                    help="Megatron's overlaps, priced: Megatron's schedules with them against 2BW without them "
                         "and with the EP overlap")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    ap.add_argument("--region", metavar="THROUGHPUT_JSON",
                    help="2BW vs ZB-V for p = 2..16 from the PP=1 costs measured by bench/throughput/pipeline_throughput.py")
    ap.add_argument("--split-overhead", type=float, default=0.04,
                    help="extra cost of a split backward, as a fraction of the plain one")
    args = ap.parse_args(argv)
    if args.region:
        one = json.loads(Path(args.region).read_text())["stage_costs"]["pp1"][0]
        p2p = json.loads(Path(args.region).read_text())["stage_costs"]["pp2"][0].get("p2p", 0.0)
        rows = zbv_region(one["fwd"], one["bwd"], one["opt"], p2p, args.split_overhead)
        print(region_report(rows))
        result = {"costs": {**one, "p2p": p2p}, "split_overhead": args.split_overhead, "rows": rows}
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
        return result
    cluster = Cluster(**{**asdict(H100), "mfu": args.mfu})
    model, pps, dp, mbs, configured_m = LAYOUTS[args.model]
    how = overlap_rows if args.overlaps else project
    rows = how(model, cluster, pps=pps, dp=dp, mbs=mbs, optimizer=args.optimizer, configured_m=configured_m,
               host_s_per_op=args.host_us_per_op * 1e-6)
    result = {"model": asdict(model), "cluster": asdict(cluster), "assumptions": ASSUMPTIONS,
              "optimizer": args.optimizer, "layout": {"dp": dp, "micro_batch": mbs},
              "host_s_per_op": args.host_us_per_op * 1e-6, "rows": rows}
    print(overlap_report(rows) if args.overlaps else report(rows))
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        print("wrote", plot(rows, args.plot))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()

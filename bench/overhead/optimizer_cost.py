"""What the optimizer step costs: AdamW, Muon and Muon + EF, with and without the
distributed optimizer, at DP=2 on CPU.

Muon orthogonalises every weight matrix with Newton-Schulz iterations each step, so
its step is dearer than Adam's; Megatron's layer-wise distributed optimizer gives
each data-parallel rank whole matrices to orthogonalise, so the work should split
between ranks. This benchmark measures the step's share of an iteration and counts,
per rank, the Newton-Schulz calls (by wrapping emerging-optimizers'
`muon_utils.newton_schulz`), so the split is checked, not assumed.

Each configuration is a pair of gloo processes (one thread each) training the
benchmark GPT (8 layers, hidden 256, sequence 128, micro-batch 4, m = 4 per rank)
through Megatron-Core's no-pipelining schedule and optimizer; the step (gradient
reduction included: `finish_grad_sync` + `optimizer.step`) and the forward-backward
are timed separately per iteration after a warm-up; medians over iterations, the
slower rank. Configurations run round-robin. Megatron's "adam" is AdamW (decoupled
weight decay; 0 here, which costs the same).

    .venv/bin/python -m bench.overhead.optimizer_cost [--repeats R] [--iters N] [--json PATH] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

from bench.results import emit

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the rank function must import as bench.overhead.optimizer_cost
    sys.path.insert(0, str(ROOT))

LAYER_WISE = dict(use_layer_wise_distributed_optimizer=True, bf16=True)  # as the runtime sets it for Muon
# (name, optimizer, distributed optimizer, EF)
CONFIGS = [
    ("adamw", "adam", False, False),
    ("adamw_distopt", "adam", True, False),
    ("muon", "muon", False, False),
    ("muon_distopt", "muon", True, False),
    ("muon_ef", "muon", False, True),
    ("muon_ef_distopt", "muon", True, True),
]
FULL_MODEL = dict(num_layers=8, hidden_size=256, num_attention_heads=4, vocab_size=4096, seq_length=128,
                  micro_batch_size=4)
QUICK_MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16,
                   micro_batch_size=2)


def spec_for(model: dict, optimizer: str, distopt: bool, m: int = 4, dp: int = 2):
    from tests.support.tiny_gpt import TinyGPT

    extra = dict(LAYER_WISE) if (distopt and optimizer == "muon") else {}
    return TinyGPT(optimizer=optimizer, use_distributed_optimizer=distopt and optimizer == "adam", lr=1e-3,
                   clip_grad=1.0, global_batch_size=model["micro_batch_size"] * m * dp,
                   extra_optimizer_config=extra, **model)


def timing_rank(rank: int, world_size: int, spec, ef: bool, warmup: int, iters: int) -> dict:
    """Median forward-backward and step seconds per iteration, and Newton-Schulz calls."""
    import torch.distributed as dist
    from emerging_optimizers.orthogonalized_optimizers import muon_utils

    from megatron_async.corrections.delay_correction import DelayCorrectedOptimizer
    from megatron_async.schedules.registry import get_forward_backward_func
    from tests.support.forward_step import gpt_forward_step
    from tests.support.tiny_gpt import build, microbatches

    calls = {"n": 0}
    original = muon_utils.newton_schulz

    def counted(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)

    muon_utils.newton_schulz = counted
    model, optimizer, _ = build(spec)
    if ef:
        optimizer = DelayCorrectedOptimizer(optimizer, ef_lambda=1.0)
    forward_backward = get_forward_backward_func("no-pipelining")
    m = spec.num_microbatches(world_size)
    fb, step, ns = [], [], []
    for it in range(warmup + iters):
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        dist.barrier()
        t0 = time.perf_counter()
        forward_backward(forward_step_func=gpt_forward_step, data_iterator=microbatches(spec, it), model=model,
                         num_microbatches=m, seq_length=spec.seq_length, micro_batch_size=spec.micro_batch_size,
                         forward_only=False)
        t1 = time.perf_counter()
        before = calls["n"]
        for chunk in model:
            chunk.finish_grad_sync()
        assert optimizer.step()[0], "optimizer step skipped"
        t2 = time.perf_counter()
        if it >= warmup:
            fb.append(t1 - t0)
            step.append(t2 - t1)
            ns.append(calls["n"] - before)
    muon_utils.newton_schulz = original
    return {"fwd_bwd": statistics.median(fb), "step": statistics.median(step), "ns_calls_per_step": max(ns)}


def main(argv=None) -> dict:
    import importlib

    from tests.support.multiprocess import run_distributed

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--quick", action="store_true", help="tiny model, one repeat, 2 iterations")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    model = QUICK_MODEL if args.quick else FULL_MODEL
    repeats, iters, warmup = (1, 2, 1) if args.quick else (args.repeats, args.iters, 2)
    rank_fn = importlib.import_module("bench.overhead.optimizer_cost").timing_rank
    runs: dict[str, list] = {name: [] for name, *_ in CONFIGS}
    for r in range(repeats):
        for name, optimizer, distopt, ef in CONFIGS:
            ranks = run_distributed(rank_fn, 2, spec_for(model, optimizer, distopt), ef, warmup, iters,
                                    timeout_s=900)
            runs[name].append(ranks)
            print(f"repeat {r + 1}/{repeats} {name}: step {max(x['step'] for x in ranks):.4f} s, "
                  f"fwd+bwd {max(x['fwd_bwd'] for x in ranks):.4f} s, Newton-Schulz calls per rank "
                  f"{[x['ns_calls_per_step'] for x in ranks]}", flush=True)
    rows = {}
    for name, samples in runs.items():
        step = statistics.median(max(x["step"] for x in ranks) for ranks in samples)
        fb = statistics.median(max(x["fwd_bwd"] for x in ranks) for ranks in samples)
        rows[name] = {"step_s": step, "fwd_bwd_s": fb, "step_share": step / (step + fb),
                      "ns_calls_per_rank": [x["ns_calls_per_step"] for x in samples[-1]]}
    result = {"date": datetime.date.today().isoformat(), "machine": f"{os.cpu_count()} cores", "model": model,
              "dp": 2, "microbatches_per_rank": 4, "iters": iters, "repeats": repeats,
              "command": "python -m bench.overhead.optimizer_cost " + " ".join(argv if argv is not None else sys.argv[1:]),
              "rows": rows}
    return emit(result, report(result), args.json)


def report(r: dict) -> str:
    lines = ["| configuration | step (s) | forward + backward (s) | step share of iteration | Newton-Schulz calls per rank |",
             "| --- | --- | --- | --- | --- |"]
    for name, row in r["rows"].items():
        lines.append(f"| {name} | {row['step_s']:.4f} | {row['fwd_bwd_s']:.4f} | {100 * row['step_share']:.1f}% | "
                     f"{row['ns_calls_per_rank']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

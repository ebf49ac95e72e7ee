"""What the weight stash costs on one GPU at a size where compute, not launches, sets the pace.

    python -m bench.overhead.gpu_stash_cost [--layers 24 --hidden 2048 ...] [--json PATH]

Megatron's own loop under torchrun (NCCL, bf16, Muon, mock data) trains the same
GPT plain and with `--simulated-delay 1` (the stash 2bw keeps: one more copy of
the weights, saved before every step), alternating plain, delay, plain, delay so
the GPU's drift hits both alike. Per run: the median s/iteration after the first
`--skip` iterations, and the peak GPU memory (torch's max_memory_allocated, from
the metrics file). The result is the ratio of the medians over the runs, and the
extra peak memory against the bf16 weights' size, which the stash is expected to
add once. Needs CUDA; `--impl transformer_engine` needs Transformer Engine.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
from pathlib import Path

from bench.results import emit

MODES = {"plain": [], "delay": ["--simulated-delay", 1]}


def run_flags(opts, mode: str, metrics: Path) -> list:
    from tests.support.gpu.gpt_flags import MUON, gpt_flags

    return gpt_flags(layers=opts.layers, hidden=opts.hidden, heads=opts.heads, seq=opts.seq,
                     micro_batch=opts.micro_batch, global_batch=opts.global_batch, iters=opts.iters,
                     impl=opts.impl) + MUON + MODES[mode] + ["--metrics-json", metrics]


def parameter_count(stdout: str) -> float | None:
    """Megatron's own count (billions), from its start-up report."""
    match = re.search(r"Total number of parameters in billions:\s*([0-9.]+)", stdout)
    return float(match.group(1)) if match else None


def summarise(per_run: dict, params_b: float | None) -> dict:
    seconds = {mode: statistics.median(r["s_per_iter"] for r in runs) for mode, runs in per_run.items()}
    peak = {mode: max(r["max_allocated_mib"] for r in runs) for mode, runs in per_run.items()}
    out = {"median_s_per_iter": seconds, "delay_over_plain": seconds["delay"] / seconds["plain"],
           "peak_mib": peak, "extra_peak_mib": peak["delay"] - peak["plain"], "params_billion": params_b}
    if params_b:
        out["bf16_weights_mib"] = params_b * 1e9 * 2 / 2**20
        out["extra_peak_over_bf16_weights"] = out["extra_peak_mib"] / out["bf16_weights_mib"]
    return out


def table(result: dict) -> str:
    s, p = result["median_s_per_iter"], result["peak_mib"]
    lines = [f"stash cost on {result['device']} ({result['impl']}, {result['params_billion']}B parameters)",
             "| mode | s/iteration (median) | peak GPU memory (MiB) |", "| --- | --- | --- |"]
    lines += [f"| {mode} | {s[mode]:.4f} | {p[mode]:.0f} |" for mode in MODES]
    lines.append(f"delay / plain: {result['delay_over_plain']:.3f}; extra peak memory {result['extra_peak_mib']:.0f} MiB"
                 + (f" = {result['extra_peak_over_bf16_weights']:.2f} x the bf16 weights"
                    if "extra_peak_over_bf16_weights" in result else ""))
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--iters", type=int, default=25)
    ap.add_argument("--skip", type=int, default=5, help="iterations left out of the timing (start-up)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--impl", choices=("local", "transformer_engine"), default="local")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json")
    opts = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench.overhead.gpu_stash_cost needs a CUDA GPU (bench.overhead.stash_overhead measures the stash on the CPU)")
    from tests.support.gpu.launch import read_metrics, tail, torchrun_gpt

    per_run, params_b = {mode: [] for mode in MODES}, None
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(opts.rounds):
            for mode in MODES:
                metrics = Path(tmp) / f"{mode}_{round_}.jsonl"
                proc = torchrun_gpt(run_flags(opts, mode, metrics), 1, opts.timeout)
                if proc.returncode != 0:
                    sys.exit(f"{mode} run {round_} failed (exit {proc.returncode}):\n{tail(proc)}")
                params_b = params_b or parameter_count(proc.stdout)
                records = [r for r in read_metrics(metrics) if "lm_loss" in r]
                timed = [r["s_per_iter"] for r in records if r["iteration"] > opts.skip]
                per_run[mode].append({"s_per_iter": statistics.median(timed),
                                      "max_allocated_mib": records[-1]["max_allocated_mib"],
                                      "final_loss": records[-1]["lm_loss"], "wall_s": round(proc.wall_s, 1)})
                print(f"{mode} round {round_}: {per_run[mode][-1]}", flush=True)
    result = {"device": torch.cuda.get_device_name(0), "impl": opts.impl, "torch": torch.__version__,
              "config": {k: v for k, v in vars(opts).items() if k != "json"}, "runs": per_run,
              **summarise(per_run, params_b)}
    return emit(result, table(result), opts.json)


if __name__ == "__main__":
    main()

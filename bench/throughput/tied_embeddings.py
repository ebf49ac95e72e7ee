"""Tied against untied embeddings under 2bw: iterations per second, side by side.

    .venv/bin/python -m bench.throughput.tied_embeddings [--repeats R] [--iters N] [--json PATH]
    .venv/bin/python -m bench.throughput.tied_embeddings --quick      # tiny model, PP=2 only, one repeat

Tied embeddings under 2bw add two point-to-point transfers per step between the
first and the last stage (the output weight's gradient, then the updated weights;
pipeline/tied_embeddings.py) where untied ones add none. Both run in Megatron's own
loop through the launcher (bench/throughput/pipeline_throughput.py's runs: mock
data, no evaluation, each rank timing itself), round-robin R times so machine noise
hits both alike, at PP=2 and PP=4. Reported: the median s/microbatch of each, and
tied / untied (the target: within 2%).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys

from bench.results import emit
from bench.throughput.pipeline_throughput import run

MODEL = dict(layers=8, hidden=256, heads=4, vocab=4096, seq=128, mbs=4)  # pipeline_throughput's FULL_MODEL
QUICK_MODEL = dict(layers=4, hidden=32, heads=4, vocab=64, seq=16, mbs=2)
TWO_BW = ["--pipeline-schedule", "2bw"]
CONFIGS = [("2bw_pp2_m8", 2, 8, TWO_BW), ("2bw_pp4_m8", 4, 8, TWO_BW)]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iters", type=int, default=40, help="training iterations per run")
    parser.add_argument("--quick", action="store_true", help="tiny model, PP=2, one repeat")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    model, configs = (QUICK_MODEL, CONFIGS[:1]) if args.quick else (MODEL, CONFIGS)
    repeats, iters = (1, 25) if args.quick else (args.repeats, args.iters)
    runs: dict[str, dict[str, list[float]]] = {c[0]: {"tied": [], "untied": []} for c in configs}
    for r in range(repeats):
        for config in configs:
            for tie in ("untied", "tied") if r % 2 == 0 else ("tied", "untied"):  # alternate who goes first
                t = run(model, config, iters, untie=tie == "untied")
                runs[config[0]][tie].append(t)
                print(f"repeat {r + 1}/{repeats} {config[0]} {tie}: {t:.4f} s/microbatch", flush=True)
    median = {name: {tie: statistics.median(v) for tie, v in by.items()} for name, by in runs.items()}
    result = {
        "date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "model": model, "iters": iters, "repeats": repeats,
        "command": "python -m bench.throughput.tied_embeddings " + " ".join(argv if argv is not None else sys.argv[1:]),
        "runs": runs, "s_per_microbatch": median,
        "tied_over_untied": {name: m["tied"] / m["untied"] for name, m in median.items()},
    }
    return emit(result, report(result), args.json)


def report(r: dict) -> str:
    lines = ["| configuration | untied s / microbatch | tied s / microbatch | tied / untied | runs (untied; tied) |",
             "| --- | --- | --- | --- | --- |"]
    for name, m in r["s_per_microbatch"].items():
        runs = r["runs"][name]
        lines.append(f"| {name} | {m['untied']:.4f} | {m['tied']:.4f} | {r['tied_over_untied'][name]:.3f} | "
                     f"{', '.join(f'{x:.4f}' for x in runs['untied'])}; {', '.join(f'{x:.4f}' for x in runs['tied'])} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

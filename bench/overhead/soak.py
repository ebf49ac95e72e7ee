"""Soak benchmark: a long 2bw run must keep its pace and its memory.

    python -m bench.overhead.soak                      # 5,000 iterations, about 10 minutes on 2 cores
    python -m bench.overhead.soak --quick              # 100 iterations (what the smoke test runs)
    python -m bench.overhead.soak --optimizer muon     # the demo's optimizer (examples/demo.sh)
    python -m bench.overhead.soak --model demo --optimizer muon --iters 1500   # the demo's model too

Trains a small GPT (4 layers, hidden 64, seq 64, micro-batch 2, global batch 8) on
the Shakespeare corpus with `--pipeline-schedule 2bw` at PP=2 on 2 CPU processes, in
Megatron's own training loop, checkpointing every 500 iterations (Megatron's
checkpoints, stash included), and reads each rank's `--rank-stats-dir`
records (mean s/iter, RSS, malloc's bytes in use and free, pending point-to-point
sends every 100 iterations). RSS that grows while malloc's bytes in use stay flat is
free memory the allocator keeps, not a leak.

Targets, per rank: the mean time per iteration of the last 500
iterations within 5% of that of iterations 500-1,000, and RSS growth after
iteration 500 below 20 MB. `--quick` scales the windows to the run length and
checks nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from bench.delay.sweep_runner import prepare_dirs
from tests.support.launch import BENCH_WARM_ENV, torchrun_megatron

MODEL = ["--num-layers", "4", "--num-attention-heads", "4", "--position-embedding-type", "learned_absolute",
         "--untie-embeddings-and-output-weights", "--rerun-mode", "disabled", "--num-workers", "0",
         "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw",
         "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "50"]
# --model demo: the sizes of examples/demo.sh, whose tensors (activations of 512 KB and up)
# are past glibc's initial mmap threshold, where the small model's are not
SIZES = {
    "small": ["--hidden-size", "64", "--seq-length", "64", "--max-position-embeddings", "64",
              "--micro-batch-size", "2", "--global-batch-size", "8"],
    "demo": ["--hidden-size", "128", "--seq-length", "128", "--max-position-embeddings", "128",
             "--micro-batch-size", "8", "--global-batch-size", "32", "--hidden-dropout", "0",
             "--attention-dropout", "0"],
}
# --optimizer muon: the demo's Muon flags (examples/demo.sh), fp32 Newton-Schulz as on a CPU
OPTIMIZER_FLAGS = {
    "adam": ["--optimizer", "adam"],
    "muon": ["--optimizer", "muon", "--muon-momentum", "0.95", "--muon-extra-scale-factor", "0.2",
             "--muon-fp32-matmul-prec", "high"],
}
TIME_TOLERANCE = 0.05
RSS_GROWTH_MB = 20.0


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _window_mean(records: list[dict], first: int, last: int) -> float:
    """Mean s/iter of iterations first+1..last, from records that each cover the interval before them."""
    values = [r["s_per_iter"] for r in records if first < r["iteration"] <= last]
    return statistics.fmean(values)


def summarise(stats_dir: Path, iters: int, settle: int) -> dict:
    """Per rank: early and late pace, RSS after `settle` and its growth, pending sends."""
    ranks = {}
    for path in sorted(stats_dir.glob("rank*.jsonl")):
        records = _records(path)
        early = _window_mean(records, settle, 2 * settle)
        late = _window_mean(records, iters - settle, iters)
        rss_settled = next(r["rss_mb"] for r in records if r["iteration"] >= settle)
        after = [r["rss_mb"] for r in records if r["iteration"] >= settle]
        ranks[path.stem] = {
            "s_per_iter_early": early,
            "s_per_iter_late": late,
            "late_over_early": late / early,
            "rss_mb_at_settle": rss_settled,
            "rss_mb_max_after": max(after),
            "rss_growth_mb": max(after) - rss_settled,
            "pending_sends": sorted({r.get("pending_sends") for r in records}),
            "curve": [(r["iteration"], r["s_per_iter"], r["rss_mb"]) for r in records],
        }
        if "heap_in_use_mb" in records[-1]:  # glibc: what RSS holds, in use or kept free by malloc
            in_use = [r["heap_in_use_mb"] for r in records if r["iteration"] >= settle]
            ranks[path.stem].update(
                heap_in_use_mb_at_settle=in_use[0], heap_in_use_growth_mb=max(in_use) - in_use[0],
                heap_free_mb_max_after=max(r["heap_free_mb"] for r in records if r["iteration"] >= settle),
                heap_curve=[(r["iteration"], r["heap_in_use_mb"], r["heap_free_mb"]) for r in records])
    return ranks


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=None, help="default 5000; 100 with --quick")
    p.add_argument("--quick", action="store_true", help="100 iterations (or --iters), windows scaled, no target check")
    p.add_argument("--out", default="out/soak")
    p.add_argument("--data", default="data/shakespeare", help="prepared corpus (megatron-async-prepare-data)")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZER_FLAGS), default="adam",
                   help="adam (AdamW), or muon with the demo's Muon flags")
    p.add_argument("--model", choices=sorted(SIZES), default="small",
                   help="small (4 layers, hidden 64), or demo: examples/demo.sh's sizes (hidden 128, seq 128, "
                        "micro-batch 8, global batch 32)")
    args = p.parse_args(argv)
    iters = args.iters or (100 if args.quick else 5000)
    settle = max(iters // 10, 1) if args.quick else 500
    interval = max(iters // 50, 1) if args.quick else 100
    root, data, _ = prepare_dirs(args.out, args.data, None)
    stats_dir = root / "rank_stats"
    cmd = MODEL + SIZES[args.model] + OPTIMIZER_FLAGS[args.optimizer] + [
        "--train-data-path", data / "train_text_document", "--valid-data-path", data / "valid_text_document",
        "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", data / "tokenizer.model",
        "--data-cache-path", root / "cache", "--train-iters", str(iters), "--log-interval", str(interval),
        "--eval-interval", str(settle), "--eval-iters", "2", "--save", root / "ckpt", "--save-interval",
        str(settle), "--rank-stats-dir", stats_dir, "--metrics-json", root / "metrics.jsonl",
    ]
    if iters <= 100:  # a short --quick run warms its learning rate up over half of it (Megatron: warm-up < decay)
        cmd += ["--lr-warmup-iters", str(min(50, iters // 2))]
    started = time.monotonic()
    # the real launcher, which is measured; warm ranks only for the smoke test (tests/support/launch.py)
    proc = torchrun_megatron(cmd, nproc=2, timeout_s=4 * 3600, warm=os.environ.get(BENCH_WARM_ENV) == "1")
    if proc.returncode != 0:
        print(proc.stdout[-5000:])
        return proc.returncode
    ranks = summarise(stats_dir, iters, settle)
    met = all(r["late_over_early"] <= 1 + TIME_TOLERANCE and r["rss_growth_mb"] < RSS_GROWTH_MB
              for r in ranks.values())
    summary = {"iters": iters, "settle": settle, "model": args.model, "optimizer": args.optimizer,
               "seconds": round(time.monotonic() - started, 1),
               "command": "torchrun --nproc-per-node 2 -m megatron_async.launch --gpt " + " ".join(map(str, cmd)),
               "targets_met": None if args.quick else met, "ranks": ranks}
    (root / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"soak ({args.model} model, {args.optimizer}): {iters} iterations in {summary['seconds']:.0f} s")
    print("| rank | s/iter, iterations "
          f"{settle + 1}-{2 * settle} | s/iter, last {settle} | late / early | RSS at {settle} (MB) | "
          f"RSS growth after {settle} (MB) | pending sends |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, r in ranks.items():
        print(f"| {name} | {r['s_per_iter_early']:.4f} | {r['s_per_iter_late']:.4f} | {r['late_over_early']:.3f} | "
              f"{r['rss_mb_at_settle']:.1f} | {r['rss_growth_mb']:.1f} | {r['pending_sends']} |")
    if all("heap_in_use_mb_at_settle" in r for r in ranks.values()):
        print(f"| rank | malloc in use at {settle} (MB) | in-use growth after {settle} (MB) | "
              f"malloc free, max after {settle} (MB) |")
        print("| --- | --- | --- | --- |")
        for name, r in ranks.items():
            print(f"| {name} | {r['heap_in_use_mb_at_settle']:.1f} | {r['heap_in_use_growth_mb']:.1f} | "
                  f"{r['heap_free_mb_max_after']:.1f} |")
    if not args.quick:
        print(f"targets (late/early <= {1 + TIME_TOLERANCE}, RSS growth < {RSS_GROWTH_MB} MB): "
              + ("met" if met else "NOT met"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

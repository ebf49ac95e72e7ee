"""Pipeline throughput inside Megatron's own training loop, on CPU processes.

    .venv/bin/python -m bench.throughput.pipeline_throughput [--repeats R] [--iters N] [--json PATH]
    .venv/bin/python -m bench.throughput.pipeline_throughput --balance [--layers 15]  # deeper model, uneven splits
    .venv/bin/python -m bench.throughput.pipeline_throughput --quick      # tiny model, two configurations

Every configuration is a real `megatron.training.pretrain` run through the launcher
(`-m megatron_async.launch --gpt`, mock data, no evaluation): PP=1, Megatron's 1F1B,
Megatron's interleaved 1F1B (2 virtual stages per rank) and our 2bw at PP=2, for
several microbatch counts m. Configurations run round-robin, R times, so machine
noise hits all alike. Each rank writes its own mean seconds per iteration every
--log-interval (`--rank-stats-dir`, no collective); the steady-state rate of a run is
the mean over the windows after the first 10 iterations, of its slower rank, per
microbatch. Efficiency is the ideal pipeline bound (PP=1's time per microbatch / 2)
over a configuration's time per microbatch; the median over repeats is reported.

After each round the per-stage costs of the same model are measured
(bench/throughput/stage_costs.py) and the cost model (bench/throughput/project.py, `predict_cpu`) turns
them into a predicted time per microbatch for each configuration: the table shows
measured and predicted side by side.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

from bench.results import emit
from tests.support.launch import start_torchrun

ROOT = Path(__file__).resolve().parents[2]

# (name, pipeline stages, microbatches per batch, extra flags)
CONFIGS = [
    ("pp1_m4", 1, 4, []),
    ("1f1b_m4", 2, 4, []),
    ("1f1b_m16", 2, 16, []),
    ("interleaved_m4", 2, 4, ["--num-virtual-stages-per-pipeline-rank", "2"]),
    ("interleaved_m16", 2, 16, ["--num-virtual-stages-per-pipeline-rank", "2"]),
    ("2bw_m2", 2, 2, ["--pipeline-schedule", "2bw"]),
    ("2bw_m4", 2, 4, ["--pipeline-schedule", "2bw"]),
    ("2bw_m16", 2, 16, ["--pipeline-schedule", "2bw"]),
]
QUICK_CONFIGS = [c for c in CONFIGS if c[0] in ("pp1_m4", "2bw_m4")]


def layout(first: int, last: int) -> list[str]:
    """Megatron's own uneven split: transformer layers on the first and the last stage."""
    return ["--decoder-first-pipeline-num-layers", str(first), "--decoder-last-pipeline-num-layers", str(last)]


def balance_configs(layers: int) -> list[tuple]:
    """Stage balance at PP=2, m=4: the last stage also computes the output layer and the
    loss, so it gets fewer transformer layers. Even depths try whole-layer splits
    (L/2 + k, L/2 - k); odd depths use Megatron's --account-for-loss-in-pipeline-split,
    which counts the loss as a layer ((L+1)/2 on the first stage, (L-1)/2 + loss on the
    last). `pp1_m4_x2` runs two PP=1 jobs at once, one per core: the bound under the
    same load as a pipeline's two busy cores."""
    two_bw = ["--pipeline-schedule", "2bw"]
    configs = [("pp1_m4", 1, 4, []), ("pp1_m4_x2", 1, 4, [])]
    if layers % 2:
        first, last = (layers + 1) // 2, (layers - 1) // 2
        loss_split = ["--account-for-loss-in-pipeline-split"]
        return configs + [(f"1f1b_m4_{first}+{last}+loss", 2, 4, loss_split),
                          (f"2bw_m4_{first}+{last}+loss", 2, 4, two_bw + loss_split),
                          (f"2bw_m4_{first + 1}+{last - 1}", 2, 4, two_bw + layout(first + 1, last - 1))]
    half = layers // 2
    return configs + [(f"1f1b_m4_{half}+{half}", 2, 4, []),
                      (f"1f1b_m4_{half + 1}+{half - 1}", 2, 4, layout(half + 1, half - 1)),
                      (f"2bw_m4_{half}+{half}", 2, 4, two_bw),
                      (f"2bw_m4_{half + 1}+{half - 1}", 2, 4, two_bw + layout(half + 1, half - 1)),
                      (f"2bw_m4_{half + 2}+{half - 2}", 2, 4, two_bw + layout(half + 2, half - 2))]


BALANCE_CONFIGS = balance_configs(16)
FULL_MODEL = dict(layers=8, hidden=256, heads=4, vocab=4096, seq=128, mbs=4)
BALANCE_MODEL = dict(FULL_MODEL, layers=16)
QUICK_MODEL = dict(layers=4, hidden=32, heads=4, vocab=64, seq=16, mbs=2)
WARMUP_ITERS = 10
LOG_INTERVAL = 5


def command(model: dict, pp: int, m: int, extra: list, iters: int, stats_dir: str, untie: bool = True) -> list[str]:
    gbs = m * model["mbs"]
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={pp}",
        "-m", "megatron_async.launch", "--gpt",
        "--num-layers", str(model["layers"]), "--hidden-size", str(model["hidden"]),
        "--num-attention-heads", str(model["heads"]), "--seq-length", str(model["seq"]),
        "--max-position-embeddings", str(model["seq"]), "--micro-batch-size", str(model["mbs"]),
        "--global-batch-size", str(gbs), *(["--untie-embeddings-and-output-weights"] if untie else []),
        "--hidden-dropout", "0", "--attention-dropout", "0", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", str(model["vocab"]), "--num-workers", "0", "--rerun-mode", "disabled",
        "--train-iters", str(iters), "--lr", "1e-4", "--log-interval", str(LOG_INTERVAL),
        "--eval-interval", str(10 * iters), "--eval-iters", "0", "--pipeline-model-parallel-size", str(pp),
        "--rank-stats-dir", stats_dir, *extra,
    ]


def seconds_per_microbatch(stats_dir: str, m: int) -> float:
    """Steady state: mean s/iter of the windows after WARMUP_ITERS, slower rank, per microbatch."""
    per_rank = []
    for path in sorted(Path(stats_dir).glob("rank*.jsonl")):
        records = [json.loads(line) for line in path.read_text().splitlines()]
        steady = [r["s_per_iter"] for r in records if r["iteration"] > WARMUP_ITERS + LOG_INTERVAL]
        if not steady:
            raise RuntimeError(f"{path}: no steady-state record (train longer than {WARMUP_ITERS} iterations)")
        per_rank.append(statistics.fmean(steady))
    return max(per_rank) / m


def run(model: dict, config: tuple, iters: int, untie: bool = True) -> float:
    """s / microbatch of one configuration; a name ending in _x2 runs two copies at once
    (their mean; separate rendezvous ports)."""
    name, pp, m, extra = config
    copies = 2 if name.endswith("_x2") else 1
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    with tempfile.TemporaryDirectory() as tmp:
        dirs = [os.path.join(tmp, str(i)) for i in range(copies)]
        procs = []
        for i, stats_dir in enumerate(dirs):
            cmd = command(model, pp, m, extra, iters, stats_dir, untie)
            if copies > 1:
                cmd = [c for c in cmd if c != "--standalone"]
                cmd[3:3] = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{29600 + i}", "--nnodes", "1"]
            procs.append(start_torchrun(cmd, cwd=ROOT, env=env))
        for done in [p.wait(1800) for p in procs]:
            if done.returncode != 0:
                raise RuntimeError(f"{name} failed:\n{done.stdout[-3000:]}")
        return statistics.fmean(seconds_per_microbatch(d, m) for d in dirs)


def predicted(model: dict, configs: list, stage_samples: list[dict]) -> dict:
    """The cost model's s / microbatch per configuration from the measured stage costs."""
    from bench.throughput.project import predict_cpu
    from bench.throughput.stage_costs import median_costs

    stages = median_costs(stage_samples)
    return {"stage_costs": stages, "predicted": predict_cpu(stages, configs)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iters", type=int, default=40, help="training iterations per run")
    parser.add_argument("--quick", action="store_true", help="tiny model, PP=1 and 2bw m=4, one repeat")
    parser.add_argument("--balance", action="store_true",
                        help="deeper model: even and uneven first/last-stage layer counts at PP=2, m=4")
    parser.add_argument("--layers", type=int, default=16,
                        help="--balance: transformer layers (odd: the loss counts as a layer in the split)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--stage-reps", type=int, default=3, help="timed batches per stage-cost run")
    args = parser.parse_args(argv)
    model, configs = (QUICK_MODEL, QUICK_CONFIGS) if args.quick else (FULL_MODEL, CONFIGS)
    if args.balance:
        model, configs = dict(BALANCE_MODEL, layers=args.layers), balance_configs(args.layers)
    repeats, iters = (1, 25) if args.quick else (args.repeats, args.iters)
    from bench.throughput.stage_costs import measure

    times: dict[str, list[float]] = {c[0]: [] for c in configs}
    stage_samples = []
    for r in range(repeats):
        for config in configs:
            times[config[0]].append(run(model, config, iters))
            print(f"repeat {r + 1}/{repeats} {config[0]}: {times[config[0]][-1]:.4f} s/microbatch", flush=True)
        stage_samples.append(measure(model, reps=1 if args.quick else args.stage_reps))
    median = {name: statistics.median(values) for name, values in times.items()}
    bound = median["pp1_m4"] / 2
    # two PP=1 jobs at once: what 2 busy cores give a whole model, so the same load as a pipeline
    same_load = median.get("pp1_m4_x2")
    result = {
        "date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "model": model, "iters": iters, "repeats": repeats,
        "command": "python -m bench.throughput.pipeline_throughput " + " ".join(argv if argv is not None else sys.argv[1:]),
        "s_per_microbatch": median, "runs": times,
        "efficiency": {name: bound / t for name, t in median.items() if not name.startswith("pp1_")},
        "efficiency_same_load": {} if same_load is None else {
            name: same_load / 2 / t for name, t in median.items() if not name.startswith("pp1_")},
        **predicted(model, configs, stage_samples),
    }
    return emit(result, report(result), args.json)


def report(r: dict) -> str:
    """Markdown table; with pp1_m4_x2 a column for the bound under the same two-core load."""
    same = r.get("efficiency_same_load") or {}
    pct = lambda e: "-" if e is None else f"{100 * e:.0f}%"  # noqa: E731
    lines = ["| configuration | s / microbatch (median) | runs | efficiency vs PP=1 / 2 |"
             + (" vs two PP=1 at once / 2 |" if same else "") + " predicted | predicted / measured |",
             "| --- | --- | --- | --- |" + (" --- |" if same else "") + " --- | --- |"]
    for name, t in r["s_per_microbatch"].items():
        pred = r["predicted"].get(name)
        runs = ", ".join(f"{x:.4f}" for x in r["runs"][name])
        lines.append(f"| {name} | {t:.4f} | {runs} | {pct(r['efficiency'].get(name))} |"
                     + (f" {pct(same.get(name))} |" if same else "")
                     + f" {'-' if pred is None else f'{pred:.4f}'} | {'-' if pred is None else f'{pred / t:.2f}'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

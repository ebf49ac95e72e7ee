"""Constant one-step delay (PipeDream-2BW) vs variable delay (original PipeDream), with Muon.

In a P-stage pipeline, 2BW takes every stage's gradient at weights one step old;
original PipeDream updates each stage per microbatch with weight stashing, so
stage s sees weights P-1-s steps old: the first stage lags most, the last not at
all. Both are modelled on one process with `--simulated-delay` (constant `1`, or
the list `P-1,...,1,0` over P would-be stages), and both clip each would-be stage
by its own gradient norm, as a real asynchronous pipeline must.

For each P in --stages: sync (once), constant delay 1, PipeDream's delays; a
short learning-rate search in sync mode first (seed 0). Every run is a
`megatron-async-pretrain` subprocess under OUT/runs/ (resumable, as
bench/delay/sweep_runner.py). Results: OUT/summary.json,
OUT/table.md, and a PNG (final validation loss against P; curves at the largest P).

    .venv/bin/python -m bench.delay.variable_delay --out out/variable_delay --img-dir docs/img
    .venv/bin/python -m bench.delay.variable_delay --quick --out /tmp/vd   # P = 4, 20 iterations
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from bench.delay.sweep_runner import Model, Run, cell, mean_curve, prepare_dirs, run_all
from megatron_async.stash.delay_reference import pipedream_delays

LR_GRID = [4e-3, 8e-3, 1.6e-2, 3.2e-2]
OPTIMIZER = "muon"


def variants(num_stages: int) -> dict[str, list[str]]:
    """Flags of the two delayed variants at P stages."""
    return {
        "constant": ["--simulated-delay", "1", "--simulated-pipeline-stages", str(num_stages)],
        "pipedream": ["--simulated-delay", ",".join(map(str, pipedream_delays(num_stages)))],
    }


def name(variant: str, num_stages: int, lr: float, seed: int) -> str:
    stages = f"_p{num_stages}" if num_stages else ""
    return f"{OPTIMIZER}_lr{lr:g}_{variant}{stages}_s{seed}"


def sync_run(lr: float, seed: int) -> Run:
    return Run(name("sync", 0, lr, seed), OPTIMIZER, lr, "sync", seed)


def summarise(stages, lr, seeds, results) -> dict:
    finals = lambda names: cell([results[n]["final_val_loss"] for n in names])
    table = {"sync": finals([name("sync", 0, lr, s) for s in seeds])}
    for p in stages:
        row = {v: finals([name(v, p, lr, s) for s in seeds]) for v in variants(p)}
        for v in variants(p):
            row[v]["gap"] = row[v]["mean"] - table["sync"]["mean"]
        row["mean_delay"] = statistics.fmean(pipedream_delays(p))
        table[f"P={p}"] = row
    return table


def markdown(table: dict, lr: float) -> str:
    fmt = lambda c: f"{c['mean']:.4f} ± {c['std']:.4f}"
    sync = table["sync"]
    lines = [f"Muon, lr {lr:g}; final validation loss (mean ± std over seeds); gap = variant − sync ({fmt(sync)}).", "",
             "| stages P | 2BW: delay 1 at every stage | gap | PipeDream: delay P−1−s | gap | PipeDream's mean delay |",
             "| --- | --- | --- | --- | --- | --- |"]
    for key, row in table.items():
        if key == "sync":
            continue
        c, v = row["constant"], row["pipedream"]
        lines.append(f"| {key[2:]} | {fmt(c)} | {c['gap']:+.4f} | {fmt(v)} | {v['gap']:+.4f} | {row['mean_delay']:.1f} |")
    return "\n".join(lines) + "\n"


def plot(table, results, stages, lr, seeds, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {"constant": "tab:blue", "pipedream": "tab:red"}
    labels = {"constant": "2BW: delay 1 everywhere", "pipedream": "PipeDream: stage s delay P-1-s"}
    sync = table["sync"]
    left.axhline(sync["mean"], color="k", ls="--", lw=1, label=f"sync {sync['mean']:.3f}")
    for v in colors:
        means = [table[f"P={p}"][v]["mean"] for p in stages]
        stds = [table[f"P={p}"][v]["std"] for p in stages]
        left.errorbar(stages, means, yerr=stds, marker="o", capsize=3, color=colors[v], label=labels[v])
    left.set_xscale("log", base=2)
    left.set_xticks(stages, [str(p) for p in stages])
    left.set_xlabel("pipeline stages P")
    left.set_ylabel("final validation loss")
    left.set_title(f"Muon, lr {lr:g}, mean of {len(seeds)} seed(s)")
    left.grid(alpha=0.3)
    left.legend()
    p, highest = stages[-1], sync["mean"]
    for v, runs in [("sync", [name("sync", 0, lr, s) for s in seeds])] + \
                   [(v, [name(v, p, lr, s) for s in seeds]) for v in colors]:
        its, mean = mean_curve([results[n]["val_curve"] for n in runs])
        right.plot(its, mean, marker="o", ms=3, color=colors.get(v, "k"), label=labels.get(v, "sync"))
        highest = max(highest, *mean)
    right.set_xlabel("iteration")
    right.set_ylabel("validation loss")
    right.set_title(f"P = {p}")
    right.set_ylim(sync["mean"] - 0.3, min(highest, sync["mean"] + 3.0) + 0.1)
    right.grid(alpha=0.3)
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="out/variable_delay")
    p.add_argument("--data", default="data/shakespeare", help="prepared corpus (megatron-async-prepare-data)")
    p.add_argument("--img-dir", default=None, help="where the PNG goes (default: OUT)")
    p.add_argument("--stages", default="4,8,16", help="pipeline depths P (each must divide the 16 layers)")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--parallel", type=int, default=2, help="runs at once (one core each)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    p.add_argument("--quick", action="store_true", help="P = 4, a 4-layer model, 20 iterations, 1 seed")
    args = p.parse_args(argv)

    root, data, img_dir = prepare_dirs(args.out, args.data, args.img_dir)
    # Deep and narrow, so that P = 16 still gives every stage a whole layer.
    model = Model(num_layers=16, hidden_size=64, heads=4)
    stages = [int(s) for s in args.stages.split(",")]
    seeds, grid = list(range(args.seeds)), LR_GRID
    if args.quick:
        model = Model(num_layers=4, hidden_size=64, seq_length=64, micro_batch_size=4, global_batch_size=8,
                      iters=20, eval_interval=10, eval_iters=2)
        stages, seeds, grid = [4], [0], [8e-3]
    bad = [s for s in stages if s < 2 or model.num_layers % s]
    if bad:
        p.error(f"--stages {bad}: each P must be >= 2 and divide the model's {model.num_layers} layers")

    total = len(grid) + (len(seeds) - 1) + 2 * len(stages) * len(seeds)
    print(f"variable delay: {total} runs ({len(grid)} lr-search, sync and 2 delayed variants x P in {stages} x "
          f"{len(seeds)} seeds), {args.parallel} at a time; GPT {model.num_layers}L/{model.hidden_size}H, "
          f"{model.iters} steps; out {root}", flush=True)
    t0, done = time.monotonic(), [0, 0]
    results = run_all([sync_run(lr, 0) for lr in grid], model, data, root, args.parallel, args.timeout,
                      done, total, t0)
    lr = min(grid, key=lambda x: results[name("sync", 0, x, 0)]["final_val_loss"])
    print(f"best sync learning rate: {lr:g}", flush=True)
    runs = [sync_run(lr, s) for s in seeds[1:]]
    runs += [Run(name(v, p_, lr, s), OPTIMIZER, lr, "sync", s, extra=flags)
             for p_ in stages for v, flags in variants(p_).items() for s in seeds]
    results.update(run_all(runs, model, data, root, args.parallel, args.timeout, done, total, t0))

    table = summarise(stages, lr, seeds, results)
    summary = dict(model=model.__dict__, lr_search={f"{x:g}": results[name("sync", 0, x, 0)]["final_val_loss"]
                                                    for x in grid},
                   lr=lr, seeds=seeds, stages=stages, table=table, wall_minutes=round((time.monotonic() - t0) / 60, 1),
                   run_seconds={n: r["seconds"] for n, r in results.items()},
                   commands={n: r["command"] for n, r in results.items()})
    (root / "summary.json").write_text(json.dumps(summary, indent=1))
    text = markdown(table, lr)
    (root / "table.md").write_text(text)
    png = img_dir / "variable_delay.png"
    plot(table, results, stages, lr, seeds, png)
    print(text + f"plot: {png}\nsummary: {root / 'summary.json'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

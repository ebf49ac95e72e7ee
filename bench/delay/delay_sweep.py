"""Optimizers under one-step delay, at CPU scale: sync vs delayed vs delayed + EF.

For each optimizer: a short learning-rate search in synchronous mode (a few
values, `--search-seeds` seeds each; the lowest mean final validation loss wins),
then at the best learning rate three modes, several seeds each:

- sync:      plain training;
- async:     `--simulated-delay 1` (the gradient of step t is taken at the
             weights of step t-1: PipeDream-2BW's rule, on one process);
- async+EF:  `--simulated-delay 1 --delay-correction ef`.

One configuration per `--twin-optimizer` is also run with the real
`--pipeline-schedule 2bw` at PP=2 next to its simulated twin (same initial
weights via `--layout-invariant-init`), to show that the simulated delay is what
the pipeline does. Optional explorations: the delay gap at every learning rate
of the grid (`--lr-curve`) and at other Muon momenta (`--muon-momenta`);
`--lr OPT=LR` skips the search for an optimizer (another lr, or longer runs
with `--iters`); `--lr-grid OPT=LR:LR` searches only the rates given (re-tuning a
longer run next to the rate a shorter one chose).

Runs are resumable (bench/delay/sweep_runner.py). Results: OUT/summary.json,
OUT/table.md and PNGs (bench/delay/delay_sweep_report.py).

    .venv/bin/python -m bench.delay.delay_sweep --out out/delay_sweep --img-dir docs/img
    .venv/bin/python -m bench.delay.delay_sweep --quick --out /tmp/sweep   # a minute: 2 x 2 x 20 iterations
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from bench.delay import delay_sweep_report as report
from bench.delay.sweep_runner import (DEFAULT_MODES, MODES, PRESETS, Model, Run, cell, prepare_dirs, run_all,
                                run_name)

LR_GRID = {
    "adam": [1e-3, 2e-3, 4e-3, 8e-3],
    "muon": [4e-3, 8e-3, 1.6e-2, 3.2e-2],
    "lion": [5e-4, 1e-3, 2e-3, 4e-3],
    "soap": [1e-3, 2e-3, 4e-3, 8e-3],
}


def momentum_run_name(lr: float, momentum: float, mode: str, seed: int) -> str:
    return run_name("muon", lr, mode, seed, f"_m{momentum:g}")


def nesterov_sync_name(lr: float, seed: int) -> str:
    return run_name("muon", lr, "sync", seed, "_nesterov")


def mode_row(results: dict, names: dict[str, list[str]]) -> dict:
    """{mode: cell, ..., gap: async - sync} from the run names of each mode."""
    row = {mode: cell([results[n]["final_val_loss"] for n in runs]) for mode, runs in names.items()}
    row["gap"] = row["async"]["mean"] - row["sync"]["mean"]
    return row


def summarise(grids, best_lr, results, seeds, search_seeds, modes) -> dict:
    table = {}
    for opt, grid in grids.items():
        row = {"best_lr": best_lr[opt],
               "lr_search": {f"{lr:g}": cell([results[run_name(opt, lr, "sync", s)]["final_val_loss"]
                                              for s in search_seeds]) for lr in grid},
               **mode_row(results, {m: [run_name(opt, best_lr[opt], m, s) for s in seeds] for m in modes})}
        gap = row["gap"]
        row["recovered"] = {m: (row["async"]["mean"] - row[m]["mean"]) / gap if gap else float("nan")
                            for m in modes if m not in ("sync", "async")}
        if "async+ef" in row:
            row["ef_recovered"] = row["recovered"]["async+ef"]
        table[opt] = row
    return table


def twin_comparison(opt: str, lr: float, results: dict) -> dict:
    a = results[run_name(opt, lr, "async", 0, "_2bw_pp2")]
    b = results[run_name(opt, lr, "async", 0, "_twin_pp1")]
    diffs = [abs(x[1] - y[1]) for x, y in zip(a["train_curve"], b["train_curve"])]
    vdiffs = [abs(x[1] - y[1]) for x, y in zip(a["val_curve"], b["val_curve"])]
    return dict(config=f"{opt}, lr {lr:g}, seed 0", iterations=len(diffs),
                max_abs_loss_diff=max(diffs), max_abs_val_diff=max(vdiffs),
                **{"2bw_final_val": a["final_val_loss"], "twin_final_val": b["final_val_loss"],
                   "2bw_seconds": a["seconds"], "twin_seconds": b["seconds"]})


def twin_runs(opt: str, lr: float) -> list[Run]:
    init = ["--layout-invariant-init"]
    return [
        Run(run_name(opt, lr, "async", 0, "_2bw_pp2"), opt, lr, "sync", 0, nproc=2,
            extra=init + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw"]),
        Run(run_name(opt, lr, "async", 0, "_twin_pp1"), opt, lr, "async", 0,
            extra=init + ["--simulated-pipeline-stages", "2"]),
    ]


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="out/delay_sweep", help="run directories, summary.json, table.md")
    p.add_argument("--data", default="data/shakespeare", help="prepared corpus (megatron-async-prepare-data)")
    p.add_argument("--img-dir", default=None, help="where the PNGs go (default: OUT)")
    p.add_argument("--optimizers", default="adam,muon,lion,soap")
    p.add_argument("--model", default="dense", choices=sorted(PRESETS),
                   help="dense: 4 layers, hidden 128 (1.9M parameters); dense-large: 8 layers, hidden 256; moe: the "
                        "dense model with 8 experts per MLP, top-2, about the same active parameters (use a separate "
                        "--archive per model: an archived run of another model is never reused)")
    p.add_argument("--muon-matmul-prec", default=None, choices=["medium", "high"],
                   help="Muon's --muon-fp32-matmul-prec (default: Megatron's, medium: bf16 Newton-Schulz, which the "
                        "CPU emulates 17-31x slower than high: bench/muon_matmul_precision); part of what an archived run must match")
    p.add_argument("--seeds", type=int, default=3, help="seeds per (optimizer, mode) at the best lr")
    p.add_argument("--search-seeds", type=int, default=2, help="seeds per learning rate in the search")
    p.add_argument("--iters", type=int, default=None, help="training iterations per run (default 150)")
    p.add_argument("--eval-interval", type=int, default=None,
                   help="validation every this many iterations (default 25; long runs: fewer evaluations)")
    p.add_argument("--lr", default="", metavar="OPT=LR,...",
                   help="fixed learning rates (e.g. adam=0.002,muon=0.008): no search for these optimizers")
    p.add_argument("--lr-grid", default="", metavar="OPT=LR:LR,...",
                   help="search these rates instead of the default grid (e.g. muon=0.004:0.008): re-tuning a "
                        "longer run around the rate a shorter one chose; archived runs are not run again")
    p.add_argument("--parallel", type=int, default=2, help="runs at once (one core each)")
    p.add_argument("--no-twin", action="store_true", help="skip the 2bw PP=2 vs simulated-twin pairs")
    p.add_argument("--twin-optimizer", default="adam",
                   help="optimizer(s), comma-separated, of the 2bw PP=2 vs simulated-twin pairs")
    p.add_argument("--lr-curve", default="",
                   help="optimizer(s) whose async runs also go at every lr of the grid (search seeds)")
    p.add_argument("--muon-momenta", default="",
                   help="also run Muon sync and async at these --muon-momentum values (best lr, same seeds); "
                        "the paper links robustness to delay with higher momentum")
    p.add_argument("--muon-nesterov-sync", action="store_true",
                   help="also run Muon sync with Megatron's --muon-nesterov (best lr, same seeds): the sync "
                        "baseline for --delay-correction nesterov, whose look-ahead makes heavy-ball momentum "
                        "Nesterov's")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES),
                   help=f"modes at the best lr, comma-separated, from {', '.join(MODES)} (sync and async always)")
    p.add_argument("--archive", default=None, metavar="DIR",
                   help="also keep each run's result as DIR/NAME.json and reuse it (commit DIR: sweeps span sessions)")
    p.add_argument("--save-interval", type=int, default=0,
                   help="Megatron checkpoints every this many steps, so that a run cut short (a session's end, "
                        "--timeout) resumes at its last checkpoint on the next invocation; removed once the run ends")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    p.add_argument("--quick", action="store_true",
                   help="adam and muon (those of them --optimizers names), sync and async, 20 iterations, 1 seed, "
                        "fixed lr: a smoke test")
    args = p.parse_args(argv)
    unknown = [o for o in args.optimizers.split(",") if o not in LR_GRID]
    if unknown:
        p.error(f"--optimizers: no learning-rate grid for {unknown}; choose from {sorted(LR_GRID)}")
    try:
        args.fixed_lr = {o: float(v) for o, v in (item.split("=") for item in args.lr.split(",") if item)}
    except ValueError:
        p.error(f"--lr: expected OPT=LR,... (e.g. adam=0.002,muon=0.008), got {args.lr!r}")
    if set(args.fixed_lr) - set(LR_GRID):
        p.error(f"--lr: unknown optimizers {sorted(set(args.fixed_lr) - set(LR_GRID))}")
    try:
        args.lr_grid = {o: sorted({float(v) for v in vs.split(":")})
                        for o, vs in (item.split("=") for item in args.lr_grid.split(",") if item)}
    except ValueError:
        p.error(f"--lr-grid: expected OPT=LR:LR,... (e.g. muon=0.004:0.008), got {args.lr_grid!r}")
    if set(args.lr_grid) - set(LR_GRID):
        p.error(f"--lr-grid: unknown optimizers {sorted(set(args.lr_grid) - set(LR_GRID))}")
    if set(args.lr_grid) & set(args.fixed_lr):
        p.error(f"--lr-grid and --lr both name {sorted(set(args.lr_grid) & set(args.fixed_lr))}: give one")
    if args.quick and not {"adam", "muon"} & set(args.optimizers.split(",")):
        p.error(f"--quick runs adam and muon only; --optimizers {args.optimizers} names neither")
    args.modes = list(dict.fromkeys(["sync", "async", *filter(None, args.modes.split(","))]))
    if set(args.modes) - set(MODES):
        p.error(f"--modes: unknown {sorted(set(args.modes) - set(MODES))}; choose from {', '.join(MODES)}")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    root, data, img_dir = prepare_dirs(args.out, args.data, args.img_dir)
    model = Model(**PRESETS[args.model], muon_matmul_prec=args.muon_matmul_prec)
    optimizers = args.optimizers.split(",")
    grids = {o: [args.fixed_lr[o]] if o in args.fixed_lr else args.lr_grid.get(o, LR_GRID[o]) for o in optimizers}
    seeds, search_seeds, modes = list(range(args.seeds)), list(range(args.search_seeds)), args.modes
    if args.quick:
        moe = dict(num_experts=model.num_experts, moe_ffn_hidden_size=128) if model.num_experts else {}
        model = Model(num_layers=2, hidden_size=64, seq_length=64, micro_batch_size=4, global_batch_size=8,
                      iters=20, eval_interval=10, eval_iters=2, muon_matmul_prec=model.muon_matmul_prec, **moe)
        optimizers = [o for o in ("adam", "muon") if o in optimizers]
        seeds, search_seeds, modes = [0], [0], ["sync", "async"]
        grids = {o: [2e-3] for o in optimizers}
    if args.eval_interval:
        model.eval_interval = args.eval_interval
    model.save_interval = args.save_interval
    if args.iters:
        model.iters = args.iters
        model.eval_interval = math.gcd(model.iters, model.eval_interval)
    twin_opts = [] if (args.quick or args.no_twin) else \
        [o for o in args.twin_optimizer.split(",") if o in optimizers] or optimizers[:1]
    curve_opts = [o for o in args.lr_curve.split(",") if o in optimizers]
    momenta = [float(m) for m in args.muon_momenta.split(",") if m] if "muon" in optimizers else []
    nesterov_seeds = seeds if args.muon_nesterov_sync and "muon" in optimizers else []

    searches = [Run(run_name(o, lr, "sync", s), o, lr, "sync", s)
                for o in optimizers for lr in grids[o] for s in search_seeds]
    reused = len(set(seeds) & set(search_seeds))  # sync runs at the best lr that the search already did
    curve_runs = sum(len(grids[o]) - 1 for o in curve_opts) * len(search_seeds)
    total = (len(searches) + len(optimizers) * (len(modes) * len(seeds) - reused) + 2 * len(twin_opts)
             + 2 * len(seeds) * len(momenta) + curve_runs + len(nesterov_seeds))
    print(f"delay sweep: {len(searches)} lr-search runs + {len(optimizers)} optimizers x {len(modes)} modes x "
          f"{len(seeds)} seeds + {2 * len(twin_opts)} twin + {curve_runs} lr-curve + {2 * len(seeds) * len(momenta)} "
          f"momentum runs = about {total} runs, {args.parallel} at a time; GPT {model.num_layers}L/"
          f"{model.hidden_size}H, seq {model.seq_length}, {model.global_batch_size} sequences/step, "
          f"{model.iters} steps; out {root}", flush=True)
    t0, done = time.monotonic(), [0, 0]
    archive = Path(args.archive).resolve() if args.archive else None
    run = lambda runs: results.update(run_all(runs, model, data, root, args.parallel, args.timeout, done, total, t0,
                                              archive))

    results: dict = {}
    # only a search with a choice to make must finish first; a fixed lr's sync runs join the rest
    choosing = [r for r in searches if len(grids[r.optimizer]) > 1]
    run(choosing)
    best_lr = {o: grids[o][0] if len(grids[o]) == 1 else
               min(grids[o], key=lambda lr: sum(results[run_name(o, lr, "sync", s)]["final_val_loss"]
                                                for s in search_seeds)) for o in optimizers}
    print("best sync learning rates: " + ", ".join(f"{o} {lr:g}" for o, lr in best_lr.items()), flush=True)
    planned = [r for r in searches if r not in choosing]
    planned += [Run(run_name(o, best_lr[o], m, s), o, best_lr[o], m, s) for o in optimizers for m in modes for s in seeds]
    for opt in twin_opts:
        planned += twin_runs(opt, best_lr[opt])
    planned += [Run(run_name(o, lr, "async", s), o, lr, "async", s)
                for o in curve_opts for lr in grids[o] for s in search_seeds]
    planned += [Run(momentum_run_name(best_lr["muon"], m, mode, s), "muon", best_lr["muon"], mode, s,
                    extra=["--muon-momentum", f"{m:g}"]) for m in momenta for mode in ("sync", "async") for s in seeds]
    planned += [Run(nesterov_sync_name(best_lr["muon"], s), "muon", best_lr["muon"], "sync", s,
                    extra=["--muon-nesterov"]) for s in nesterov_seeds]
    unique = {r.name: r for r in planned if r.name not in results}
    run(sorted(unique.values(), key=lambda r: r.seed))  # seed 0 of every cell first: an early full picture

    table = summarise(grids, best_lr, results, seeds, search_seeds, modes)
    twins = [twin_comparison(o, best_lr[o], results) for o in twin_opts]
    lr_curve = {o: {f"{lr:g}": mode_row(results, {m: [run_name(o, lr, m, s) for s in search_seeds]
                                                         for m in ("sync", "async")}) for lr in grids[o]}
                for o in curve_opts}
    momentum = {f"{m:g}": mode_row(results, {mode: [momentum_run_name(best_lr["muon"], m, mode, s)
                                                          for s in seeds] for mode in ("sync", "async")})
                for m in momenta}
    nesterov_sync = cell([results[nesterov_sync_name(best_lr["muon"], s)]["final_val_loss"]
                          for s in nesterov_seeds]) if nesterov_seeds else None
    summary = dict(model=model.__dict__, seeds=seeds, search_seeds=search_seeds, lr_grid=grids, table=table,
                   twin=twins, lr_curve=lr_curve, muon_momentum=momentum,
                   muon_nesterov_sync=nesterov_sync,
                   wall_minutes_this_invocation=round((time.monotonic() - t0) / 60, 1),
                   run_seconds={n: r["seconds"] for n, r in results.items()},
                   commands={n: r["command"] for n, r in results.items()})
    (root / "summary.json").write_text(json.dumps(summary, indent=1))
    text = (report.markdown(table, twins) + report.lr_markdown(lr_curve)
            + report.momentum_markdown(momentum, table.get("muon"))
            + report.nesterov_sync_markdown(nesterov_sync, table.get("muon")))
    (root / "table.md").write_text(text)
    pngs = report.plot(table, results, seeds, img_dir) + report.plot_lr(lr_curve, img_dir)
    print(text + "plots: " + ", ".join(pngs) + f"\nsummary: {root / 'summary.json'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

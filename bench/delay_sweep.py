"""Optimizers under one-step delay, at CPU scale: sync vs delayed vs delayed + EF.

For each optimizer: a short learning-rate search in synchronous mode (seed 0),
then at the best learning rate three modes, several seeds each:

- sync:      plain training;
- async:     `--simulated-delay 1` (the gradient of step t is taken at the
             weights of step t-1: PipeDream-2BW's rule, on one process);
- async+EF:  `--simulated-delay 1 --delay-correction ef`.

One configuration is also run with the real `--pipeline-schedule 2bw` at PP=2
next to its simulated twin (same initial weights via `--layout-invariant-init`),
to show that the simulated delay is what the pipeline does.

Every run is a `megatron-async-pretrain` subprocess with its own directory under
OUT/runs/; a finished run leaves result.json there and is skipped next time, so
an interrupted sweep resumes where it stopped. Results: OUT/summary.json,
OUT/table.md and a validation-loss PNG per optimizer.

    .venv/bin/python -m bench.delay_sweep --out out/delay_sweep --img-dir docs/img
    .venv/bin/python -m bench.delay_sweep --quick --out /tmp/sweep   # a minute: 2 x 2 x 20 iterations
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent

# Learning-rate grids. Muon runs with spectral scaling and an extra factor 0.2 (its
# update RMS matches AdamW's), so Muon and the Adam it uses for embeddings, output
# layer and 1-D parameters share one --lr on the AdamW scale.
LR_GRID = {
    "adam": [1e-3, 2e-3, 4e-3, 8e-3],
    "muon": [4e-3, 8e-3, 1.6e-2, 3.2e-2],
    "lion": [5e-4, 1e-3, 2e-3, 4e-3],
    "soap": [1e-3, 2e-3, 4e-3, 8e-3],
}
OPTIMIZER_FLAGS = {
    "muon": ["--muon-momentum", "0.95", "--muon-extra-scale-factor", "0.2"],
}
MODES = {
    "sync": [],
    "async": ["--simulated-delay", "1"],
    "async+ef": ["--simulated-delay", "1", "--delay-correction", "ef"],
}
PAPER = {  # Zmushko et al. 2026, SmolLM-360M on FineWeb-Edu, final validation loss
    "muon": {"sync": 2.578, "async": 2.590, "async+ef": 2.583},
}


@dataclass
class Model:
    num_layers: int = 4
    hidden_size: int = 128
    heads: int = 4
    seq_length: int = 128
    micro_batch_size: int = 8
    global_batch_size: int = 16
    iters: int = 150
    eval_interval: int = 25
    eval_iters: int = 10

    def flags(self) -> list[str]:
        return [
            "--num-layers", str(self.num_layers), "--hidden-size", str(self.hidden_size),
            "--num-attention-heads", str(self.heads), "--seq-length", str(self.seq_length),
            "--max-position-embeddings", str(self.seq_length),
            "--micro-batch-size", str(self.micro_batch_size), "--global-batch-size", str(self.global_batch_size),
            "--train-iters", str(self.iters), "--eval-interval", str(self.eval_interval),
            "--eval-iters", str(self.eval_iters), "--log-interval", str(self.eval_interval),
            "--untie-embeddings-and-output-weights", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--lr-decay-style", "cosine", "--lr-warmup-iters", str(max(1, self.iters // 10)),
            "--weight-decay", "0.1", "--clip-grad", "1.0",
        ]


@dataclass
class Run:
    name: str
    optimizer: str
    lr: float
    mode: str
    seed: int
    nproc: int = 1
    extra: list = field(default_factory=list)

    def args(self, model: Model, data: Path, out: Path) -> list[str]:
        return [
            *model.flags(), "--optimizer", self.optimizer, *OPTIMIZER_FLAGS.get(self.optimizer, []),
            "--lr", f"{self.lr:g}", "--min-lr", f"{self.lr / 10:g}", "--seed", str(self.seed),
            *MODES[self.mode], *self.extra,
            "--train-data-path", str(data / "train_text_document"),
            "--valid-data-path", str(data / "valid_text_document"),
            "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(data / "tokenizer.model"),
            "--data-cache-path", str(data / "cache"), "--device", "cpu",
            "--metrics-json", str(out / "metrics.jsonl"),
        ]


def run_name(optimizer: str, lr: float, mode: str, seed: int, tag: str = "") -> str:
    return f"{optimizer}_lr{lr:g}_{mode}_s{seed}{tag}"


def execute(run: Run, model: Model, data: Path, root: Path, timeout_s: float) -> dict:
    """Run one training job unless its result.json exists; return the result."""
    out = root / "runs" / run.name
    result_path = out / "result.json"
    if result_path.exists():
        return {**json.loads(result_path.read_text()), "skipped": True}
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").unlink(missing_ok=True)
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(run.nproc),
           "-m", "megatron_async.pretrain_gpt", *run.args(model, data, out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    start = time.monotonic()
    with open(out / "train.log", "w", encoding="utf-8") as log:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
    seconds = time.monotonic() - start
    if proc.returncode != 0:
        tail = (out / "train.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"run {run.name} failed (exit {proc.returncode}); see {out / 'train.log'}:\n{tail}")
    records = [json.loads(line) for line in open(out / "metrics.jsonl", encoding="utf-8")]
    vals = [(r["iteration"], r["val_loss"]) for r in records if "val_loss" in r]
    losses = [(r["iteration"], r["lm_loss"]) for r in records if r.get("lm_loss") is not None]
    result = dict(name=run.name, optimizer=run.optimizer, lr=run.lr, mode=run.mode, seed=run.seed,
                  nproc=run.nproc, final_val_loss=vals[-1][1], val_curve=vals, train_curve=losses,
                  seconds=round(seconds, 1), command=" ".join(cmd[1:]))
    result_path.write_text(json.dumps(result))
    return result


def run_all(runs: list[Run], model: Model, data: Path, root: Path, parallel: int, timeout_s: float,
            done: list[int], total: int, t0: float) -> dict[str, dict]:
    """Run `runs` `parallel` at a time, printing a progress line per finished run.
    `done` counts [finished, skipped] across calls, for the ETA."""
    results = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=parallel) as pool:
        futures = {pool.submit(execute, r, model, data, root, timeout_s): r for r in runs}
        for future in concurrent.futures.as_completed(futures):
            result = future.result()
            results[result["name"]] = result
            done[0] += 1
            done[1] += bool(result.get("skipped"))
            elapsed = time.monotonic() - t0
            fresh = done[0] - done[1]  # runs that trained in this invocation
            eta = elapsed / max(fresh, 1) * (total - done[0]) if fresh else float("nan")
            state = "skipped (done before)" if result.get("skipped") else f"{result['seconds']:.0f} s"
            print(f"[{done[0]:3d}/{total}] {result['name']:34s} final val {result['final_val_loss']:.4f} "
                  f"| {state} | elapsed {elapsed / 60:.1f} min | ETA {eta / 60:.1f} min", flush=True)
    return results


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summarise(optimizers, best_lr, results, seeds) -> dict:
    table = {}
    for opt in optimizers:
        row = {"best_lr": best_lr[opt], "lr_search": {}}
        for lr in LR_GRID_ACTIVE[opt]:
            r = results.get(run_name(opt, lr, "sync", 0))
            if r:
                row["lr_search"][f"{lr:g}"] = r["final_val_loss"]
        for mode in MODES if not QUICK else ("sync", "async"):
            finals = [results[run_name(opt, best_lr[opt], mode, s)]["final_val_loss"] for s in seeds]
            row[mode] = dict(zip(("mean", "std"), mean_std(finals)), runs=finals)
        gap = row["async"]["mean"] - row["sync"]["mean"]
        row["gap"] = gap
        if "async+ef" in row:
            row["ef_recovered"] = (row["async"]["mean"] - row["async+ef"]["mean"]) / gap if gap else float("nan")
        table[opt] = row
    return table


def markdown(table: dict, twins: list[dict]) -> str:
    lines = ["| optimizer | best lr | sync | async (delay 1) | async + EF | gap async − sync | EF recovers |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    fmt = lambda cell: f"{cell['mean']:.4f} ± {cell['std']:.4f}" if cell else "–"
    for opt, row in table.items():
        ef = row.get("async+ef")
        rec = f"{100 * row['ef_recovered']:.0f}%" if "ef_recovered" in row else "–"
        lines.append(f"| {opt} | {row['best_lr']:g} | {fmt(row['sync'])} | {fmt(row['async'])} | {fmt(ef)} | "
                     f"{row['gap']:+.4f} | {rec} |")
    for opt, paper in PAPER.items():
        gap = paper["async"] - paper["sync"]
        rec = (paper["async"] - paper["async+ef"]) / gap
        lines.append(f"| {opt} (paper, 360M) | | {paper['sync']:.3f} | {paper['async']:.3f} | "
                     f"{paper['async+ef']:.3f} | {gap:+.3f} | {100 * rec:.0f}% |")
    for twin in twins:
        lines += ["", f"2bw PP=2 vs its `--simulated-delay 1` twin ({twin['config']}): max |Δ train loss| over "
                      f"{twin['iterations']} iterations {twin['max_abs_loss_diff']:.2e}, max |Δ val loss| "
                      f"{twin['max_abs_val_diff']:.2e}, final validation {twin['2bw_final_val']:.4f} vs "
                      f"{twin['twin_final_val']:.4f}."]
    return "\n".join(lines) + "\n"


def momentum_run_name(lr: float, momentum: float, mode: str, seed: int) -> str:
    return run_name("muon", lr, mode, seed, f"_m{momentum:g}")


def momentum_row(finals: list[list[float]]) -> dict:
    """{sync, async: mean/std/runs, gap} from [sync finals, async finals]."""
    row = {mode: dict(zip(("mean", "std"), mean_std(f)), runs=f) for mode, f in zip(("sync", "async"), finals)}
    row["gap"] = row["async"]["mean"] - row["sync"]["mean"]
    return row


def momentum_markdown(momentum: dict, muon_row) -> str:
    if not momentum:
        return ""
    rows = dict(momentum)
    if muon_row:
        rows[OPTIMIZER_FLAGS["muon"][1] + " (main table)"] = muon_row
    fmt = lambda cell: f"{cell['mean']:.4f} ± {cell['std']:.4f}"
    lines = ["", "Muon momentum (same lr and seeds):", "",
             "| --muon-momentum | sync | async (delay 1) | gap |", "| --- | --- | --- | --- |"]
    for key, row in sorted(rows.items()):
        lines.append(f"| {key} | {fmt(row['sync'])} | {fmt(row['async'])} | {row['gap']:+.4f} |")
    return "\n".join(lines) + "\n"


def plot(table, results, seeds, img_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    colors = {"sync": "tab:blue", "async": "tab:red", "async+ef": "tab:green"}
    for opt, row in table.items():
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for mode in colors:
            if mode not in row:
                continue
            curves = [results[run_name(opt, row["best_lr"], mode, s)]["val_curve"] for s in seeds]
            its = [it for it, _ in curves[0]]
            mean = [statistics.fmean(c[i][1] for c in curves) for i in range(len(its))]
            ax.plot(its, mean, marker="o", ms=3, color=colors[mode],
                    label=f"{mode}: {row[mode]['mean']:.3f}")
            train = [results[run_name(opt, row["best_lr"], mode, s)]["train_curve"] for s in seeds]
            tits = [it for it, _ in train[0]]
            tmean = [statistics.fmean(c[i][1] for c in train) for i in range(len(tits))]
            ax.plot(tits, tmean, color=colors[mode], alpha=0.25, lw=0.8)
        ax.set_xlabel("iteration")
        ax.set_ylabel("loss (validation: markers; train: faint)")
        ax.set_title(f"{opt}, lr {row['best_lr']:g}: mean of {len(seeds)} seed(s)")
        finals = [row[m]["mean"] for m in colors if m in row]
        ax.set_ylim(min(finals) - 0.3, min(finals) + 2.5)
        ax.grid(alpha=0.3)
        ax.legend(title="final validation loss")
        fig.tight_layout()
        path = img_dir / f"reproduction_{opt}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(str(path))
    return paths


def prepare_dirs(out: str, data: str, img_dir) -> tuple[Path, Path, Path]:
    """Absolute output, data and image directories; prepares the corpus if it is missing."""
    root, data_dir = Path(out).resolve(), Path(data).resolve()
    img = Path(img_dir).resolve() if img_dir else root
    root.mkdir(parents=True, exist_ok=True)
    img.mkdir(parents=True, exist_ok=True)
    if not (data_dir / "tokenizer.model").exists():
        subprocess.run([str(BIN / "megatron-async-prepare-data"), "--out", str(data_dir)], check=True)
    return root, data_dir, img


def main(argv=None) -> int:
    global LR_GRID_ACTIVE, QUICK
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="out/delay_sweep", help="run directories, summary.json, table.md")
    p.add_argument("--data", default="data/shakespeare", help="prepared corpus (megatron-async-prepare-data)")
    p.add_argument("--img-dir", default=None, help="where the PNGs go (default: OUT)")
    p.add_argument("--optimizers", default="adam,muon,lion,soap")
    p.add_argument("--seeds", type=int, default=3, help="seeds per (optimizer, mode) at the best lr")
    p.add_argument("--iters", type=int, default=None, help="training iterations per run (default 150)")
    p.add_argument("--parallel", type=int, default=2, help="runs at once (one core each)")
    p.add_argument("--no-twin", action="store_true", help="skip the 2bw PP=2 vs simulated-twin pair")
    p.add_argument("--twin-optimizer", default="adam",
                   help="optimizer(s), comma-separated, of the 2bw PP=2 vs simulated-twin pairs")
    p.add_argument("--muon-momenta", default="",
                   help="also run Muon sync and async at these --muon-momentum values (best lr, same seeds); "
                        "the paper links robustness to delay with higher momentum")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    p.add_argument("--quick", action="store_true",
                   help="adam and muon, sync and async, 20 iterations, 1 seed, fixed lr: a smoke test")
    args = p.parse_args(argv)

    QUICK = args.quick
    root, data, img_dir = prepare_dirs(args.out, args.data, args.img_dir)

    model = Model()
    optimizers = args.optimizers.split(",") if not args.quick else ["adam", "muon"]
    unknown = [o for o in optimizers if o not in LR_GRID]
    if unknown:
        p.error(f"--optimizers: no learning-rate grid for {unknown}; choose from {sorted(LR_GRID)}")
    seeds = list(range(args.seeds)) if not args.quick else [0]
    LR_GRID_ACTIVE = {o: LR_GRID[o] for o in optimizers}
    if args.quick:
        model = Model(num_layers=2, hidden_size=64, seq_length=64, micro_batch_size=4, global_batch_size=8,
                      iters=20, eval_interval=10, eval_iters=2)
        LR_GRID_ACTIVE = {o: [2e-3] for o in optimizers}
    if args.iters:
        model.iters = args.iters
        model.eval_interval = math.gcd(model.iters, model.eval_interval)
    modes = ["sync", "async"] if args.quick else list(MODES)

    searches = [Run(run_name(o, lr, "sync", 0), o, lr, "sync", 0) for o in optimizers for lr in LR_GRID_ACTIVE[o]]
    per_opt_main = (len(modes) * len(seeds)) - 1  # sync seed 0 comes from the search
    twin_opts = [] if (args.quick or args.no_twin) else \
        [o for o in args.twin_optimizer.split(",") if o in optimizers] or optimizers[:1]
    twin_runs = 2 * len(twin_opts)
    momenta = [float(m) for m in args.muon_momenta.split(",") if m] if "muon" in optimizers else []
    total = len(searches) + len(optimizers) * per_opt_main + twin_runs + 2 * len(seeds) * len(momenta)
    print(f"delay sweep: {len(searches)} lr-search runs + {len(optimizers)} optimizers x {len(modes)} modes x "
          f"{len(seeds)} seeds + {twin_runs} twin runs = {total} runs, {args.parallel} at a time; "
          f"GPT {model.num_layers}L/{model.hidden_size}H, seq {model.seq_length}, {model.global_batch_size} "
          f"sequences/step, {model.iters} steps; out {root}", flush=True)
    t0, done = time.monotonic(), [0, 0]

    results = run_all(searches, model, data, root, args.parallel, args.timeout, done, total, t0)
    best_lr = {o: min(LR_GRID_ACTIVE[o], key=lambda lr: results[run_name(o, lr, "sync", 0)]["final_val_loss"])
               for o in optimizers}
    print("best sync learning rates: " + ", ".join(f"{o} {lr:g}" for o, lr in best_lr.items()), flush=True)
    main_runs = [Run(run_name(o, best_lr[o], m, s), o, best_lr[o], m, s)
                 for o in optimizers for m in modes for s in seeds
                 if run_name(o, best_lr[o], m, s) not in results]
    init = ["--layout-invariant-init"]
    for opt in twin_opts:
        main_runs += [
            Run(run_name(opt, best_lr[opt], "async", 0, "_2bw_pp2"), opt, best_lr[opt], "sync", 0, nproc=2,
                extra=init + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw"]),
            Run(run_name(opt, best_lr[opt], "async", 0, "_twin_pp1"), opt, best_lr[opt], "async", 0,
                extra=init + ["--simulated-pipeline-stages", "2"]),
        ]
    main_runs += [Run(momentum_run_name(best_lr["muon"], m, mode, s), "muon", best_lr["muon"], mode, s,
                      extra=["--muon-momentum", f"{m:g}"])
                  for m in momenta for mode in ("sync", "async") for s in seeds]
    results.update(run_all(main_runs, model, data, root, args.parallel, args.timeout, done, total, t0))
    twins = []
    for opt in twin_opts:
        a = results[run_name(opt, best_lr[opt], "async", 0, "_2bw_pp2")]
        b = results[run_name(opt, best_lr[opt], "async", 0, "_twin_pp1")]
        diffs = [abs(x[1] - y[1]) for x, y in zip(a["train_curve"], b["train_curve"])]
        vdiffs = [abs(x[1] - y[1]) for x, y in zip(a["val_curve"], b["val_curve"])]
        twins.append(dict(config=f"{opt}, lr {best_lr[opt]:g}, seed 0", iterations=len(diffs),
                          max_abs_loss_diff=max(diffs), max_abs_val_diff=max(vdiffs),
                          **{"2bw_final_val": a["final_val_loss"], "twin_final_val": b["final_val_loss"],
                             "2bw_seconds": a["seconds"], "twin_seconds": b["seconds"]}))

    table = summarise(optimizers, best_lr, results, seeds)
    momentum = {f"{m:g}": momentum_row([[results[momentum_run_name(best_lr["muon"], m, mode, s)]["final_val_loss"]
                                         for s in seeds] for mode in ("sync", "async")]) for m in momenta}
    summary = dict(model=model.__dict__, seeds=seeds, lr_grid=LR_GRID_ACTIVE, table=table, twin=twins,
                   muon_momentum=momentum,
                   wall_minutes=round((time.monotonic() - t0) / 60, 1),
                   run_seconds={n: r["seconds"] for n, r in results.items()},
                   commands={n: r["command"] for n, r in results.items()})
    (root / "summary.json").write_text(json.dumps(summary, indent=1))
    text = markdown(table, twins) + momentum_markdown(momentum, table.get("muon"))
    (root / "table.md").write_text(text)
    pngs = plot(table, results, seeds, img_dir)
    print(text + "plots: " + ", ".join(pngs) + f"\nsummary: {root / 'summary.json'}", flush=True)
    return 0


LR_GRID_ACTIVE: dict = {}
QUICK = False

if __name__ == "__main__":
    sys.exit(main())

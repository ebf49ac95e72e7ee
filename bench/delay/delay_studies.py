"""The one-step delay on other models: MoE routing, Muon's momentum, model size.

Three reports, each rebuilt from runs kept in bench/archive by bench/delay/delay_sweep.py
(one JSON per run, its command line included), so docs/reproduction.md's tables are
checked against them by tests/test_delay_studies.py:

    # MoE against dense at equal tokens: gaps, EF's recovery, and what the delay does to routing
    python -m bench.delay.delay_studies moe --dense bench/archive/shakespeare_600 \\
        --dense bench/archive/shakespeare_600_fp32ns --moe bench/archive/shakespeare_moe_600 \\
        --plot docs/img/moe_routing.png
    # Muon's gap at each --muon-momentum (the paper: higher momentum absorbs the staleness)
    python -m bench.delay.delay_studies momentum --archive bench/archive/shakespeare_600_fp32ns
    # Muon's and AdamW's relative gap against parameters (the paper: it shrinks with size)
    python -m bench.delay.delay_studies size --archive bench/archive/shakespeare_600_fp32ns \\
        --archive bench/archive/shakespeare_large_600 --plot docs/img/delay_size.png

Every comparison is at one length and one learning rate per (model, optimizer): the
rate with the lowest sync loss in that archive (bench/delay/delay_length.py's rule, judged on
the seeds every rate has). Gaps are given per seed as well as their mean, since two
seeds are all a CPU run affords.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from bench.delay import archive_summary, delay_length
from bench.results import emit, save_figure
from bench.delay.sweep_runner import MUON_MOMENTUM, Model

MODES = ("sync", "async", "async+ef")


def _flags(command: str) -> dict[str, str]:
    words = command.split()
    return dict(zip(words, words[1:] + [""]))


def model_of(run: dict) -> Model:
    """The network (and Newton-Schulz precision) a run trained with, from its command line."""
    f = _flags(run["command"])
    return Model(num_layers=int(f["--num-layers"]), hidden_size=int(f["--hidden-size"]),
                 heads=int(f["--num-attention-heads"]), seq_length=int(f["--seq-length"]),
                 num_experts=int(f.get("--num-experts", 0)), moe_ffn_hidden_size=int(f.get("--moe-ffn-hidden-size", 0)),
                 moe_topk=int(f.get("--moe-router-topk", 2)), muon_matmul_prec=f.get("--muon-fp32-matmul-prec"))


def label(model: Model) -> str:
    name = f"{model.num_layers}L/{model.hidden_size}H"
    name += f", {model.num_experts} experts top-{model.moe_topk}" if model.num_experts else ""
    return name + (f", NS {model.muon_matmul_prec}" if model.muon_matmul_prec else "")


def load(directory) -> list[dict]:
    """Every archived run of `directory`, with its momentum and network read off its command."""
    runs = []
    for path in sorted(Path(directory).glob("*.json")):
        run = json.loads(path.read_text())
        if "_twin" in path.stem or "_2bw" in path.stem or "nesterov" in path.stem.split("_s")[-1]:
            continue
        flags = _flags(run["command"])
        run["momentum"] = float(flags.get("--muon-momentum", MUON_MOMENTUM)) if run["optimizer"] == "muon" else None
        run["iters"] = int(flags["--train-iters"])
        runs.append(run)
    return runs


def tuned_rows(directory) -> list[dict]:
    """bench/delay/delay_length.py's rows of an archive at their tuned rates, each with its model,
    parameter count and the per-seed relative gaps."""
    rows = delay_length.tuned(delay_length.rows(archive_summary.summaries(Path(directory))))
    runs = load(directory)
    for row in rows:
        mine = [r for r in runs if r["optimizer"] == row["optimizer"] and r["lr"] == row["lr"]
                and r["iters"] == row["iters"] and r["momentum"] in (None, float(MUON_MOMENTUM))]
        model = model_of(mine[0])
        row["model"] = label(model)
        row["parameters"] = next((r["parameters"] for r in mine if r.get("parameters")), model.parameters())
        by = {(r["mode"], r["seed"]): r["final_val_loss"] for r in mine}
        seeds = sorted(s for m, s in by if m == "sync" and ("async", s) in by)
        row["relative_gap_by_seed"] = [(by[("async", s)] - by[("sync", s)]) / by[("sync", s)] for s in seeds]
        row["runs"] = {k: v for k, v in ((m, [r for r in mine if r["mode"] == m]) for m in MODES) if v}
    return rows


def missing_runs(directory, seeds=(0, 1), modes=MODES, optimizers=("adam", "muon")) -> list[str]:
    """The runs a study still lacks in `directory`: for each of `optimizers`, `modes`
    (sync, delay, delay + EF) on every seed at the rate with the lowest seed-0 sync loss (the sweep
    runs its whole rate search before these, so a rate search not yet done shows as the
    delayed runs missing). Empty: every table row rests on all its runs."""
    runs = [r for r in load(directory) if r["momentum"] in (None, float(MUON_MOMENTUM))]
    missing = []
    for opt in optimizers:
        search = {r["lr"]: r["final_val_loss"] for r in runs if r["optimizer"] == opt and r["mode"] == "sync"
                  and r["seed"] == seeds[0]}
        if not search:
            missing.append(f"{opt}: no sync run on seed {seeds[0]}")
            continue
        lr = min(search, key=search.get)
        have = {(r["mode"], r["seed"]) for r in runs if r["optimizer"] == opt and r["lr"] == lr}
        missing += [f"{opt} lr {lr:g} {mode} seed {seed}" for mode in modes for seed in seeds
                    if (mode, seed) not in have]
    return missing


def gap_table(rows: list[dict]) -> str:
    """Models side by side: gap, relative gap per seed, EF's recovery."""
    lines = ["| model | parameters | optimizer | steps | lr | seeds | sync | async | gap / sync | per seed | "
             "EF recovers |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in sorted(rows, key=lambda r: (r["parameters"], r["optimizer"])):
        ef = r["recovered"].get("EF")
        lines.append(f"| {r['model']} | {r['parameters'] / 1e6:.2f}M | {r['optimizer']} | {r['iters']} | {r['lr']:g} "
                     f"| {r['seeds']} | {r['sync']:.4f} | {r['async_']:.4f} | {100 * r['relative_gap']:.2f}% | "
                     + ", ".join(f"{100 * g:.2f}%" for g in r["relative_gap_by_seed"]) + " | "
                     + (f"{100 * ef:.0f}% |" if ef is not None else "– |"))
    return "\n".join(lines)


def _seeds(k: int) -> str:
    return f"{k} seed{'' if k == 1 else 's'}"


def moe_targets(rows: list[dict]) -> str:
    """The MoE targets: Muon's gap < 2% of its sync loss, AdamW's >= 3x Muon's."""
    moe = {r["optimizer"]: r for r in rows if "experts" in r["model"]}
    if not {"adam", "muon"} <= set(moe):
        return "MoE targets: AdamW and Muon have not both run yet."
    muon, adam = moe["muon"], moe["adam"]
    ratio = adam["gap"] / muon["gap"] if muon["gap"] > 0 else float("inf")
    seeds = _seeds(muon["seeds"]) if muon["seeds"] == adam["seeds"] else \
        f"Muon {_seeds(muon['seeds'])}, AdamW {_seeds(adam['seeds'])}"  # a verdict says what it rests on
    return (f"MoE targets at {muon['iters']} steps, {seeds}: Muon's gap {100 * muon['relative_gap']:.2f}% of its sync loss "
            f"(target < 2%: {'met' if muon['relative_gap'] < 0.02 else 'not met'}); AdamW's gap {ratio:.1f}x "
            f"Muon's (target >= 3x: {'met' if ratio >= 3 else 'not met'}).")


def _window_means(runs: list[dict], key: str) -> list[float]:
    """The mean over seeds of a routing series (windows of --eval-interval steps)."""
    series = [r["routing"][key] for r in runs if "routing" in r]
    return [statistics.fmean(v) for v in zip(*series)] if series else []


def routing_table(rows: list[dict]) -> str:
    """Aux loss and load imbalance (max / mean tokens per expert, mean over layers) in the
    first, middle and last windows, the imbalance's mean over all windows, and the worst
    layer's last window, sync against delayed; the per-seed last-window imbalance to read
    the difference against."""
    lines = ["| optimizer | mode | seeds | aux loss: first / middle / last | imbalance: first / middle / last | "
             "imbalance, mean of windows | worst layer, last | last imbalance per seed |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in sorted((r for r in rows if "experts" in r["model"]), key=lambda r: r["optimizer"]):
        for mode, runs in r["runs"].items():
            runs = sorted((x for x in runs if "routing" in x), key=lambda x: x["seed"])
            if not runs:
                continue
            aux, imb = _window_means(runs, "aux_loss"), _window_means(runs, "load_imbalance")
            pick = lambda xs: " / ".join(f"{xs[i]:.3f}" for i in (0, len(xs) // 2, -1))
            worst = statistics.fmean(max(x["routing"]["load_imbalance_layers"][-1]) for x in runs)
            lines.append(f"| {r['optimizer']} | {mode} | {len(runs)} | {pick(aux)} | {pick(imb)} | "
                         f"{statistics.fmean(imb):.3f} | {worst:.3f} | "
                         + ", ".join(f"{x['routing']['load_imbalance'][-1]:.3f}" for x in runs) + " |")
    return "\n".join(lines)


def plot_routing(rows: list[dict], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    moe = sorted((r for r in rows if "experts" in r["model"]), key=lambda r: r["optimizer"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    styles = {"sync": "-", "async": "--", "async+ef": ":"}
    colours = {"adam": "tab:red", "muon": "tab:blue"}
    for r in moe:
        for mode, runs in r["runs"].items():
            runs = [x for x in runs if "routing" in x]
            if not runs:
                continue
            its = runs[0]["routing"]["iterations"]
            for ax, key in zip(axes, ("load_imbalance", "aux_loss")):
                ax.plot(its, _window_means(runs, key), linestyle=styles[mode], color=colours.get(r["optimizer"]),
                        label=f"{r['optimizer']} {mode}")
    axes[0].set(xlabel="step", ylabel="max / mean tokens per expert", title="expert-load imbalance (mean of layers)")
    axes[1].set(xlabel="step", ylabel="Megatron's load_balancing_loss", title="aux loss (mean of layers)")
    return save_figure(fig, axes, path)


def momentum_rows(directory) -> list[dict]:
    """Muon's sync and delayed runs at each momentum, at the archive's tuned Muon rate."""
    muon = next((r for r in tuned_rows(directory) if r["optimizer"] == "muon"), None)
    if muon is None:
        return []
    cells = defaultdict(dict)
    for run in load(directory):
        if run["optimizer"] == "muon" and run["lr"] == muon["lr"] and run["mode"] in ("sync", "async"):
            cells[run["momentum"]][(run["mode"], run["seed"])] = run["final_val_loss"]
    out = []
    for momentum, by in sorted(cells.items()):
        seeds = sorted(s for m, s in by if m == "sync" and ("async", s) in by)
        if not seeds:
            continue
        sync, delayed = ([by[(m, s)] for s in seeds] for m in ("sync", "async"))
        gaps = [(a - s) / s for s, a in zip(sync, delayed)]
        out.append(dict(momentum=momentum, lr=muon["lr"], iters=muon["iters"], seeds=seeds,
                        sync=statistics.fmean(sync), async_=statistics.fmean(delayed),
                        gap=statistics.fmean(delayed) - statistics.fmean(sync), relative_gap_by_seed=gaps,
                        relative_gap=statistics.fmean(gaps)))
    return out


def momentum_table(rows: list[dict]) -> str:
    lines = ["| --muon-momentum | steps | lr | seeds | sync | async | gap | gap / sync | per seed |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['momentum']:g} | {r['iters']} | {r['lr']:g} | {len(r['seeds'])} | {r['sync']:.4f} | "
                     f"{r['async_']:.4f} | {r['gap']:+.4f} | {100 * r['relative_gap']:.2f}% | "
                     + ", ".join(f"{100 * g:.2f}%" for g in r["relative_gap_by_seed"]) + " |")
    return "\n".join(lines)


def plot_size(rows: list[dict], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # one panel per optimizer: AdamW's gap is ~5x Muon's, and on a shared axis Muon's change is invisible
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    dense = [r for r in rows if "experts" not in r["model"]]
    series = {"adam": [("adam", [r for r in dense if r["optimizer"] == "adam"])],
              "muon": [(f"muon, Newton-Schulz {p}", [r for r in dense if r["optimizer"] == "muon"
                                                      and (("NS high" in r["model"]) == (p == "high"))])
                       for p in ("default", "high")]}
    for ax, (opt, colour) in zip(axes, (("adam", "tab:red"), ("muon", "tab:blue"))):
        for (name, mine), style in zip(series[opt], ("-o", "--s")):
            if not mine:
                continue
            mine = sorted(mine, key=lambda r: r["parameters"])
            xs = [r["parameters"] for r in mine]
            ys = [100 * r["relative_gap"] for r in mine]
            lo = [y - 100 * min(r["relative_gap_by_seed"]) for y, r in zip(ys, mine)]
            hi = [100 * max(r["relative_gap_by_seed"]) - y for y, r in zip(ys, mine)]
            ax.errorbar(xs, ys, yerr=[lo, hi], fmt=style, capsize=4, color=colour, label=f"{name} (bars: seeds)")
        ax.set(xscale="log", xlabel="parameters", ylabel="gap async - sync, % of sync loss", title=opt)
    fig.suptitle("one-step delay gap vs model size (equal tokens)")
    return save_figure(fig, axes, path, legend_fontsize=8)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("study", choices=["moe", "momentum", "size"])
    ap.add_argument("--dense", action="append", default=[],
                    help="moe: the dense model's archive(s) at the same length (repeatable)")
    ap.add_argument("--moe", help="moe: the MoE model's archive")
    ap.add_argument("--archive", action="append", default=[], help="momentum, size: archive(s) (repeatable)")
    ap.add_argument("--plot")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.study == "moe":
        if not (args.dense and args.moe):
            ap.error("moe: give --dense and --moe archives")
        rows = [r for d in args.dense for r in tuned_rows(d)] + tuned_rows(args.moe)
        text = "\n\n".join([gap_table(rows), moe_targets(rows), routing_table(rows)])
        if args.plot:
            plot_routing(rows, args.plot)
        return emit({"rows": rows}, text, args.json)
    if not args.archive:
        ap.error(f"{args.study}: give --archive")
    if args.study == "momentum":
        rows = [r for d in args.archive for r in momentum_rows(d)]
        return emit({"rows": rows}, momentum_table(rows), args.json)
    rows = [r for d in args.archive for r in tuned_rows(d)]
    missing = {d: missing_runs(d, optimizers=sorted({r["optimizer"] for r in load(d)} | {"adam", "muon"}))
               for d in args.archive}
    if args.plot:
        plot_size(rows, args.plot)
    text = gap_table(rows) + "".join(f"\n\nnot yet in {d} ({len(m)} runs): {'; '.join(m)}"
                                     for d, m in missing.items() if m)
    return emit({"rows": rows, "missing": missing}, text, args.json)


if __name__ == "__main__":
    main()

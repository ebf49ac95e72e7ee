"""The delay gap as training grows: one table and one plot from delay sweeps of several lengths.

The paper's claim (a one-step delay costs Muon little) is about long runs; at CPU
scale the gap is large after 150 steps. This reads the summary.json of
bench/delay/delay_sweep.py runs at several `--iters` (same model, corpus and modes) and
reports, per optimizer and length: the sync loss, the gap async - sync, the gap
relative to the sync loss, and the share of the gap each correction recovers, with
the delay studies' targets at the longest length (Muon's gap < 2% of its sync loss,
AdamW's gap >= 3x Muon's, EF recovering >= 50% of Muon's gap).

Learning rates can be re-tuned per length: pass several summaries of the same
length (one per learning rate) and each (optimizer, length) keeps all its rows,
the one with the lowest sync loss marked tuned. The targets and the plot read the
tuned rows, so the choice is made by the sync loss alone, never by the gap. Rates
are compared on the seeds they all have (a rate whose second seed has not finished
is judged against the others' first seed, not against their two-seed mean).

    .venv/bin/python -m bench.delay.delay_length out/len150/summary.json out/len600/summary.json \\
        --plot docs/img/delay_length.png --json out/delay_length.json

`--archive DIR` reads the runs kept in the repository instead (bench/delay/archive_summary.py):
every learning rate and seed that has run at that length, no training needed. A rate
tried in sync alone (a re-tuning check, `delay_sweep --lr-grid`) has no row; the
report compares it with the tuned row and says whether that row still wins.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.delay import archive_summary
from bench.delay.delay_sweep_report import CORRECTIONS
from bench.results import emit, save_figure


def _per_seed_recovery(row: dict, mode: str) -> list[float]:
    """The share of each seed's own gap that a correction recovers (seed order): how far
    the mean share can be trusted when the gap is small."""
    return [(a - c) / (a - s) if a != s else float("nan")
            for s, a, c in zip(row["sync"]["runs"], row["async"]["runs"], row[mode]["runs"])]


def rows(summaries: list[dict]) -> list[dict]:
    """One row per (optimizer, length), sorted by optimizer then length."""
    out = []
    for summary in summaries:
        model = summary["model"]
        tokens = model["iters"] * model["global_batch_size"] * model["seq_length"]
        for opt, row in summary["table"].items():
            sync = row["sync"]["mean"]
            by_seed = dict(zip(summary.get("seeds", range(len(row["sync"]["runs"]))), row["sync"]["runs"]))
            out.append(dict(optimizer=opt, iters=model["iters"], tokens=tokens, lr=row["best_lr"], sync=sync,
                            async_=row["async"]["mean"], gap=row["gap"], relative_gap=row["gap"] / sync,
                            seeds=len(row["sync"]["runs"]), sync_by_seed=by_seed,
                            recovered={CORRECTIONS[m]: v for m, v in row.get("recovered", {}).items()},
                            recovered_by_seed={CORRECTIONS[m]: _per_seed_recovery(row, m)
                                               for m in row.get("recovered", {})}))
    out.sort(key=lambda r: (r["optimizer"], r["iters"], r["lr"]))
    for row in out:
        rivals = [r for r in out if (r["optimizer"], r["iters"]) == (row["optimizer"], row["iters"])]
        shared = set.intersection(*(set(r["sync_by_seed"]) for r in rivals))
        row["tuned_on_seeds"] = sorted(shared)
        row["tuned"] = row is min(rivals, key=lambda r: sum(r["sync_by_seed"][s] for s in shared) / len(shared)
                                  if shared else r["sync"])
    return out


def tuned(table: list[dict]) -> list[dict]:
    """The rows at each (optimizer, length)'s best sync learning rate."""
    return [r for r in table if r["tuned"]]


def sync_checks(table: list[dict], searched: list[dict]) -> list[dict]:
    """Rates tried in sync alone (bench/delay/archive_summary.sync_only) against the tuned row of
    their (optimizer, length), on the seeds both have: `lower` says the tuned rate lost."""
    out = []
    for check in searched:
        row = next((r for r in tuned(table) if (r["optimizer"], r["iters"]) == (check["optimizer"], check["iters"])),
                   None)
        shared = sorted(set(check["sync_by_seed"]) & set(row["sync_by_seed"])) if row else []
        if not shared:
            continue
        mean = lambda by_seed: sum(by_seed[s] for s in shared) / len(shared)
        out.append(dict(check, seeds=shared, sync=mean(check["sync_by_seed"]), tuned_lr=row["lr"],
                        tuned_sync=mean(row["sync_by_seed"]),
                        lower=mean(check["sync_by_seed"]) < mean(row["sync_by_seed"])))
    return out


def targets(table: list[dict]) -> dict:
    """The targets at the longest length that has both AdamW and Muon, at their tuned rates."""
    table = tuned(table)
    lengths = {r["iters"] for r in table if r["optimizer"] == "adam"} & {r["iters"] for r in table
                                                                          if r["optimizer"] == "muon"}
    if not lengths:
        return {}
    longest = max(lengths)
    adam, muon = (next(r for r in table if r["optimizer"] == o and r["iters"] == longest) for o in ("adam", "muon"))
    return {"iters": longest,
            "muon_relative_gap": muon["relative_gap"], "muon_relative_gap_below_2pct": muon["relative_gap"] < 0.02,
            "adam_over_muon_gap": adam["gap"] / muon["gap"] if muon["gap"] else float("inf"),
            "adam_gap_at_least_3x": muon["gap"] <= 0 or adam["gap"] >= 3 * muon["gap"],
            "ef_recovers_muon": muon["recovered"].get("EF"),
            "ef_recovers_muon_by_seed": muon["recovered_by_seed"].get("EF"),
            "ef_recovers_at_least_half": (muon["recovered"].get("EF") or 0) >= 0.5,
            "adam_lr": adam["lr"], "muon_lr": muon["lr"]}


def report(table: list[dict], goal: dict, checks: list[dict] = ()) -> str:
    names = sorted({k for r in table for k in r["recovered"]})
    retuned = any(not r["tuned"] for r in table)
    lines = ["| optimizer | steps | tokens | lr | seeds | sync | async | gap | gap / sync |"
             + "".join(f" {n} recovers |" for n in names),
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |" + " --- |" * len(names)]
    for r in table:
        rec = "".join(f" {100 * r['recovered'][n]:.0f}% |" if n in r["recovered"] else " – |" for n in names)
        lr = f"**{r['lr']:g}**" if retuned and r["tuned"] else f"{r['lr']:g}"
        lines.append(f"| {r['optimizer']} | {r['iters']} | {r['tokens'] / 1e6:.2f}M | {lr} | {r['seeds']} | "
                     f"{r['sync']:.4f} | {r['async_']:.4f} | {r['gap']:+.4f} | {100 * r['relative_gap']:.1f}% |" + rec)
    if retuned:
        lines += ["", "Bold: the learning rate with the lowest sync loss at that length, compared on the seeds "
                      "all its rates have (the targets use it)."]
    if checks:
        lines.append("")
    for c in checks:
        lines.append(f"- Sync only: {c['optimizer']} at {c['iters']} steps, lr {c['lr']:g}: {c['sync']:.4f} against "
                     f"{c['tuned_sync']:.4f} at {c['tuned_lr']:g} (seed {', '.join(str(s) for s in c['seeds'])}): "
                     + ("lower, so the bold rate is not the tuned one until this rate's delayed runs are in."
                        if c["lower"] else "higher, so the bold rate stays."))
    if goal:
        lines += ["", f"Targets at {goal['iters']} steps (AdamW {goal['adam_lr']:g}, Muon {goal['muon_lr']:g}): "
                      f"Muon's gap {100 * goal['muon_relative_gap']:.1f}% of its "
                      f"sync loss (target < 2%: {'met' if goal['muon_relative_gap_below_2pct'] else 'not met'}); "
                      f"AdamW's gap {goal['adam_over_muon_gap']:.1f}x Muon's (target >= 3x: "
                      f"{'met' if goal['adam_gap_at_least_3x'] else 'not met'}); "
                      + (f"EF recovers {100 * goal['ef_recovers_muon']:.0f}% of Muon's gap (per seed: "
                         + ", ".join(f"{100 * v:.0f}%" for v in goal["ef_recovers_muon_by_seed"])
                         + "; target >= 50%: "
                         f"{'met' if goal['ef_recovers_at_least_half'] else 'not met'})."
                         if goal["ef_recovers_muon"] is not None else
                         "EF on Muon at this rate: not run yet (target >= 50%).")]
    return "\n".join(lines)


def plot(table: list[dict], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    table = tuned(table)
    for opt, colour in (("adam", "tab:red"), ("muon", "tab:blue"), ("lion", "tab:olive"), ("soap", "tab:purple")):
        mine = [r for r in table if r["optimizer"] == opt]
        if not mine:
            continue
        left.plot([r["tokens"] for r in mine], [100 * r["relative_gap"] for r in mine], marker="o", color=colour,
                  label=opt)
        for name, style in (("EF", "-"), ("DC-ASGD", ":"), ("prediction", "--"), ("Nesterov", "-.")):
            pts = [(r["tokens"], 100 * r["recovered"][name]) for r in mine if name in r["recovered"]]
            if pts:
                right.plot(*zip(*pts), marker="o", linestyle=style, color=colour, label=f"{opt}, {name}")
    left.set(xscale="log", xlabel="tokens seen", ylabel="gap async - sync, % of sync loss",
             title="one-step delay gap vs training length")
    right.set(xscale="log", xlabel="tokens seen", ylabel="% of the gap recovered", title="corrections")
    right.axhline(50, color="grey", lw=0.8)
    ticks = sorted({(r["tokens"], r["iters"]) for r in table})
    for ax in (left, right):
        ax.set_xticks([t for t, _ in ticks], [f"{t / 1e6:.2f}M\n{n} steps" for t, n in ticks])
        ax.minorticks_off()
    return save_figure(fig, (left, right), path)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("summaries", nargs="*", help="summary.json of bench/delay/delay_sweep.py runs of different --iters")
    ap.add_argument("--archive", action="append", default=[], metavar="DIR",
                    help="a bench/delay/delay_sweep.py --archive directory (repeatable): every rate and seed kept there")
    ap.add_argument("--plot")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if not args.summaries and not args.archive:
        ap.error("give summary.json files or --archive directories")
    table = rows([json.loads(Path(p).read_text()) for p in args.summaries]
                 + [s for d in args.archive for s in archive_summary.summaries(Path(d))])
    checks = sync_checks(table, [c for d in args.archive for c in archive_summary.sync_only(Path(d))])
    goal = targets(table)
    if args.plot:
        plot(table, args.plot)
    return emit({"rows": table, "targets": goal, "sync_checks": checks, "summaries": args.summaries,
                 "archives": args.archive}, report(table, goal, checks), args.json)


if __name__ == "__main__":
    main()

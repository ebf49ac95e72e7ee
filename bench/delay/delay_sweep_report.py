"""Tables (markdown) and plots (PNG) of bench/delay/delay_sweep.py's summary."""

from __future__ import annotations

from pathlib import Path

from bench.delay.sweep_runner import MUON_MOMENTUM, mean_curve, run_name

PAPER = {  # Zmushko et al. 2026, SmolLM-360M on FineWeb-Edu, final validation loss
    "muon": {"sync": 2.578, "async": 2.590, "async+ef": 2.583},
}
COLORS = {"sync": "tab:blue", "async": "tab:red", "async+ef": "tab:green", "async+dc": "tab:purple",
          "async+predict": "tab:orange", "async+nesterov": "tab:brown"}
CORRECTIONS = {"async+ef": "EF", "async+dc": "DC-ASGD", "async+predict": "prediction",
               "async+nesterov": "Nesterov"}


def _fmt(cell) -> str:
    return f"{cell['mean']:.4f} ± {cell['std']:.4f}" if cell else "–"


def markdown(table: dict, twins: list[dict]) -> str:
    extra = [m for m in CORRECTIONS if any(m in row for row in table.values()) and m != "async+ef"]
    lines = ["| optimizer | best lr | sync | async (delay 1) | async + EF | gap async − sync | EF recovers |"
             + "".join(f" async + {CORRECTIONS[m]} | {CORRECTIONS[m]} recovers |" for m in extra),
             "| --- | --- | --- | --- | --- | --- | --- |" + " --- | --- |" * len(extra)]
    for opt, row in table.items():
        rec = f"{100 * row['ef_recovered']:.0f}%" if "ef_recovered" in row else "–"
        more = "".join(f" {_fmt(row.get(m))} | {100 * row['recovered'][m]:.0f}% |" for m in extra)
        lines.append(f"| {opt} | {row['best_lr']:g} | {_fmt(row['sync'])} | {_fmt(row['async'])} | "
                     f"{_fmt(row.get('async+ef'))} | {row['gap']:+.4f} | {rec} |" + more)
    for opt, paper in PAPER.items():
        gap = paper["async"] - paper["sync"]
        rec = (paper["async"] - paper["async+ef"]) / gap
        lines.append(f"| {opt} (paper, 360M) | | {paper['sync']:.3f} | {paper['async']:.3f} | "
                     f"{paper['async+ef']:.3f} | {gap:+.3f} | {100 * rec:.0f}% |")
    lines += ["", "Learning-rate search (sync, mean over the search seeds):", ""]
    for opt, row in table.items():
        lines.append(f"- {opt}: " + ", ".join(f"{lr}: {c['mean']:.3f}" for lr, c in row["lr_search"].items()))
    for twin in twins:
        lines += ["", f"2bw PP=2 vs its `--simulated-delay 1` twin ({twin['config']}): max |Δ train loss| over "
                      f"{twin['iterations']} iterations {twin['max_abs_loss_diff']:.2e}, max |Δ val loss| "
                      f"{twin['max_abs_val_diff']:.2e}, final validation {twin['2bw_final_val']:.4f} vs "
                      f"{twin['twin_final_val']:.4f}."]
    return "\n".join(lines) + "\n"


def lr_markdown(lr_curve: dict) -> str:
    """Delay gap at every learning rate of the grid."""
    if not lr_curve:
        return ""
    lines = ["", "Gap at every learning rate (search seeds):", "",
             "| optimizer | lr | sync | async (delay 1) | gap |", "| --- | --- | --- | --- | --- |"]
    for opt, rows in lr_curve.items():
        for lr, row in rows.items():
            lines.append(f"| {opt} | {lr} | {_fmt(row['sync'])} | {_fmt(row['async'])} | {row['gap']:+.4f} |")
    return "\n".join(lines) + "\n"


def momentum_markdown(momentum: dict, muon_row) -> str:
    if not momentum:
        return ""
    rows = dict(momentum)
    if muon_row:
        rows[MUON_MOMENTUM + " (main table)"] = muon_row
    lines = ["", "Muon momentum (same lr and seeds):", "",
             "| --muon-momentum | sync | async (delay 1) | gap |", "| --- | --- | --- | --- |"]
    for key, row in sorted(rows.items()):
        lines.append(f"| {key} | {_fmt(row['sync'])} | {_fmt(row['async'])} | {row['gap']:+.4f} |")
    return "\n".join(lines) + "\n"


def nesterov_sync_markdown(nesterov_sync, muon_row) -> str:
    """Muon sync with Nesterov momentum next to the main row's sync, delayed and
    delayed + Nesterov look-ahead: whether the look-ahead beats sync because it adds
    Nesterov's momentum."""
    if not nesterov_sync or not muon_row:
        return ""
    return "\n".join(["", "Muon sync with --muon-nesterov (same lr and seeds):", "",
                      "| sync | sync, --muon-nesterov | async (delay 1) | async + Nesterov look-ahead |",
                      "| --- | --- | --- | --- |",
                      f"| {_fmt(muon_row['sync'])} | {_fmt(nesterov_sync)} | {_fmt(muon_row['async'])} | "
                      f"{_fmt(muon_row.get('async+nesterov'))} |"]) + "\n"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(table, results, seeds, img_dir: Path) -> list[str]:
    """Per optimizer: validation (markers) and train (faint) loss of each mode at the best lr."""
    plt = _pyplot()
    paths = []
    for opt, row in table.items():
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for mode, color in COLORS.items():
            if mode not in row:
                continue
            runs = [results[run_name(opt, row["best_lr"], mode, s)] for s in seeds]
            ax.plot(*mean_curve([r["val_curve"] for r in runs]), marker="o", ms=3, color=color,
                    label=f"{mode}: {row[mode]['mean']:.3f}")
            ax.plot(*mean_curve([r["train_curve"] for r in runs]), color=color, alpha=0.25, lw=0.8)
        ax.set_xlabel("iteration")
        ax.set_ylabel("loss (validation: markers; train: faint)")
        ax.set_title(f"{opt}, lr {row['best_lr']:g}: mean of {len(seeds)} seed(s)")
        finals = [row[m]["mean"] for m in COLORS if m in row]
        ax.set_ylim(min(finals) - 0.3, min(finals) + 2.5)
        ax.grid(alpha=0.3)
        ax.legend(title="final validation loss")
        fig.tight_layout()
        path = img_dir / f"reproduction_{opt}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(str(path))
    return paths


def plot_lr(lr_curve: dict, img_dir: Path) -> list[str]:
    """Final validation loss against lr, sync and async, one panel per optimizer."""
    if not lr_curve:
        return []
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(lr_curve), figsize=(5.2 * len(lr_curve), 4.0), squeeze=False)
    for ax, (opt, rows) in zip(axes[0], lr_curve.items()):
        lrs = [float(lr) for lr in rows]
        for mode in ("sync", "async"):
            ax.errorbar(lrs, [r[mode]["mean"] for r in rows.values()], yerr=[r[mode]["std"] for r in rows.values()],
                        marker="o", capsize=3, color=COLORS[mode], label=mode)
        for lr, row in zip(lrs, rows.values()):
            ax.annotate(f"{row['gap']:+.2f}", (lr, row["async"]["mean"]), textcoords="offset points",
                        xytext=(0, 6), ha="center", fontsize=8, color=COLORS["async"])
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.set_ylabel("final validation loss")
        ax.set_title(f"{opt}: gap async − sync at each lr")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path = img_dir / "reproduction_lr.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [str(path)]

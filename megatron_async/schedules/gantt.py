"""Gantt chart of a simulated schedule (PNG, matplotlib Agg backend).

One row per stage, stage 0 on top. Each box is one forward (blue) or backward
(orange) with its microbatch number and the weight version it uses; the fill shade
alternates with the version, so the switch to new weights is visible at a glance.
A combined step (a forward beside another microbatch's backward) is purple, with
both microbatches ("forward+backward") and the forward's version.
Optimizer steps are green (a line when they cost nothing), waits in a step
collective grey.
"""

from __future__ import annotations

from typing import Optional

from megatron_async.schedules.simulator import SimResult

COLOURS = {
    "forward": ("#9ecae9", "#4c78a8"),  # (even version, odd version)
    "backward": ("#ffbf79", "#f58518"),
    "backward_input": ("#ffbf79", "#f58518"),  # the input half of a split backward, same colour
    "backward_weight": ("#b5e3a1", "#72b7b2"),
    "forward_backward": ("#c5b0d5", "#9467bd"),
    "optimizer": ("#54a24b", "#54a24b"),
    "sync": ("#d0d0d0", "#d0d0d0"),
}


def plot_gantt(result: SimResult, path: str, title: Optional[str] = None) -> str:
    """Write the chart of `result` to `path` and return the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    p, span = result.num_stages, max(result.makespan, 1e-9)
    width = min(max(8.0, 0.32 * span + 2.0), 40.0)
    fig, ax = plt.subplots(figsize=(width, 0.55 * p + 1.6))
    unit = (width - 1.5) / span  # inches per time unit, to decide what text fits
    for e in result.events:
        y, dur = p - 1 - e.stage, e.end - e.start
        if e.kind == "optimizer" and dur == 0:
            ax.plot([e.start, e.start], [y - 0.45, y + 0.45], color=COLOURS["optimizer"][0], lw=2.5)
            continue
        shade = COLOURS[e.kind][(e.version or 0) % 2]
        ax.add_patch(Rectangle((e.start, y - 0.4), dur, 0.8, facecolor=shade, edgecolor="black", lw=0.5,
                               hatch="//" if e.kind == "sync" else None))
        if e.microbatch is not None and dur * unit > 0.12:
            mbs = f"{e.microbatch}+{e.paired[0]}" if e.paired else f"{e.microbatch}"
            label = f"{mbs}\nv{e.version}" if dur * unit > 0.22 else mbs
            ax.text(e.start + dur / 2, y, label, ha="center", va="center", fontsize=7, linespacing=0.9)
        elif e.kind == "optimizer" and dur * unit > 0.12:
            ax.text(e.start + dur / 2, y, f"s{e.step}", ha="center", va="center", fontsize=6, color="white")
    ax.set_xlim(0, span)
    ax.set_ylim(-0.6, p - 0.4)
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"stage {p - 1 - y}" for y in range(p)])
    ax.set_xlabel("time (box text: microbatch, weight version)")
    summary = f"makespan {result.makespan:g}, bubble {100 * result.bubble_fraction:.1f}%"
    ax.set_title(f"{title}: {summary}" if title else summary, fontsize=10)
    handles = [Patch(facecolor=COLOURS["forward"][0], edgecolor="black", lw=0.5, label="forward"),
               Patch(facecolor=COLOURS["backward"][0], edgecolor="black", lw=0.5, label="backward"),
               Patch(facecolor=COLOURS["forward"][1], edgecolor="black", lw=0.5, label="darker: odd version"),
               *([Patch(facecolor=COLOURS["backward_weight"][0], edgecolor="black", lw=0.5,
                        label="weight gradient")] if any(e.kind == "backward_weight" for e in result.events) else []),
               *([Patch(facecolor=COLOURS["forward_backward"][0], edgecolor="black", lw=0.5,
                        label="combined step")] if any(e.kind == "forward_backward" for e in result.events) else []),
               Patch(facecolor=COLOURS["optimizer"][0], label="optimizer step")]
    if any(e.kind == "sync" for e in result.events):
        handles.append(Patch(facecolor=COLOURS["sync"][0], hatch="//", label="wait in step collective"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.5 / (0.55 * p + 1.6) - 0.12),
              ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

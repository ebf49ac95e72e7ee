"""Delay-sweep summaries rebuilt from an archive of runs, one per learning rate.

bench/delay/delay_sweep.py keeps every finished run in `--archive DIR` (in the
repository), one JSON per run. A sweep's summary.json covers one learning rate
per optimizer and only the seeds it was asked for; the archive holds every rate
and seed that ever ran at that length. This groups the archived runs by
(optimizer, learning rate) and summarises each group over the seeds that have both
a sync and a delayed run, with the corrections every one of those seeds has, so a
table built from it shows what has run, partial cells included (their seed count
says so), and a doc's table can be checked against it.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from bench.delay.delay_sweep import summarise
from bench.delay.sweep_runner import run_name


def _flag(command: str, name: str) -> int:
    """An integer flag's value in a run's recorded command line."""
    words = command.split()
    return int(words[words.index(name) + 1])


def _groups(directory: Path) -> dict[tuple[str, float], dict[str, dict]]:
    """The archived runs of each (optimizer, lr), by run name (twin and momentum runs left out)."""
    groups: dict[tuple[str, float], dict[str, dict]] = defaultdict(dict)
    for path in sorted(Path(directory).glob("*.json")):
        run = json.loads(path.read_text())
        if path.stem == run_name(run["optimizer"], run["lr"], run["mode"], run["seed"]):  # not a twin or momentum run
            groups[(run["optimizer"], run["lr"])][path.stem] = run
    return dict(sorted(groups.items()))


def _modes_and_seeds(runs: dict[str, dict]) -> set[tuple[str, int]]:
    return {(r["mode"], r["seed"]) for r in runs.values()}


def _paired_seeds(have: set[tuple[str, int]]) -> list[int]:
    """The seeds with both a sync and a delayed run, of a group's (mode, seed) pairs."""
    return sorted(s for m, s in have if m == "sync" and ("async", s) in have)


def summaries(directory: Path) -> list[dict]:
    """One delay_sweep-shaped summary per (optimizer, lr) with a sync and a delayed run."""
    out = []
    for (opt, lr), runs in _groups(directory).items():
        have = _modes_and_seeds(runs)
        seeds = _paired_seeds(have)
        if not seeds:
            continue
        corrections = sorted({m for m, _ in have} - {"sync", "async"})
        modes = ["sync", "async"] + [m for m in corrections if all((m, s) in have for s in seeds)]
        command = next(iter(runs.values()))["command"]
        model = {"iters": _flag(command, "--train-iters"), "global_batch_size": _flag(command, "--global-batch-size"),
                 "seq_length": _flag(command, "--seq-length")}
        table = summarise({opt: [lr]}, {opt: lr}, runs, seeds, seeds[:1], modes)
        out.append({"model": model, "seeds": seeds, "table": table})
    return out


def sync_only(directory: Path) -> list[dict]:
    """The rates tried in sync alone (a re-tuning check that lost, so no delayed run
    followed): {optimizer, lr, iters, sync_by_seed}, one per (optimizer, lr)."""
    out = []
    for (opt, lr), runs in _groups(directory).items():
        sync = {r["seed"]: r["final_val_loss"] for r in runs.values() if r["mode"] == "sync"}
        if sync and not _paired_seeds(_modes_and_seeds(runs)):
            iters = _flag(next(iter(runs.values()))["command"], "--train-iters")
            out.append(dict(optimizer=opt, lr=lr, iters=iters, sync_by_seed=sync))
    return out

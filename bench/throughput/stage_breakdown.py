"""Where each rank's time goes in Megatron's loop: model math, optimizer step, the rest.

    .venv/bin/python -m bench.throughput.stage_breakdown [--layers 15] [--repeats 2] [--json PATH]
    .venv/bin/python -m bench.throughput.stage_breakdown --quick

Wall-clock comparisons against PP=1 (bench/throughput/pipeline_throughput.py) mix three things:
the schedule (bubble, imbalance), the runtime's own cost, and the machine (two busy
cores are slower than one, and a shared machine drifts by 10% between runs). This
benchmark separates them inside each run: every rank times Megatron's own
`forward_step` and `backward_step` (which 1F1B and our 2bw executor both call), its
optimizer step and its whole iterations, over the same steady-state window. The
*busy share* of a rank is (forward + backward + step) / iteration time: whatever is
not busy is bubble, waiting on a neighbour, point-to-point work, Python and
Megatron's bookkeeping. A pipeline's busy share (mean over its ranks) divided by
PP=1's busy share is its efficiency under its own load: 100% would be a pipeline
that wastes no more time around its model math than a single process does.

Every configuration is a real `pretrain()` job (GPT, mock data, 2 CPU processes of
one thread each), run through this file as the launched script, which wraps the
timed functions and then runs `megatron_async.launch` unchanged.
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
import time
from pathlib import Path

from tests.support.launch import start_torchrun

ROOT = Path(__file__).resolve().parents[2]
FIRST_TIMED_ITERATION = 10  # iterations before this are warm-up (allocation, first-touch, stream start)


# --- inside each launched rank ---------------------------------------------------
class Clock:
    """Per-rank accumulators, timed from iteration FIRST_TIMED_ITERATION on."""

    def __init__(self):
        self.totals = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        self.iterations = 0
        self.started = None  # time the first timed iteration began
        self.count = 0
        self.elapsed = 0.0

    def timed(self, name, func):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return func(*args, **kwargs)
            finally:
                if self.started is not None:
                    self.totals[name] += time.perf_counter() - t0

        return wrapper

    def iteration_begins(self) -> None:
        self.count += 1
        if self.count == FIRST_TIMED_ITERATION:
            self.started = time.perf_counter()

    def iteration_ends(self) -> None:
        if self.started is not None:
            self.iterations += 1
            self.elapsed = time.perf_counter() - self.started

    def record(self) -> dict:
        return {"iterations": self.iterations, "elapsed": self.elapsed, **self.totals}


def _instrument(clock: Clock) -> None:
    """Wrap Megatron's per-microbatch steps, its train_step and the optimizer's step."""
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.training.training as training

    schedules.forward_step = clock.timed("forward", schedules.forward_step)
    schedules.backward_step = clock.timed("backward", schedules.backward_step)
    train_step = training.train_step

    def timed_train_step(*args, **kwargs):
        clock.iteration_begins()
        optimizer = args[3] if len(args) > 3 else kwargs["optimizer"]
        if not getattr(optimizer, "_breakdown_timed", False):
            optimizer.step = clock.timed("step", optimizer.step)
            optimizer._breakdown_timed = True
        try:
            return train_step(*args, **kwargs)
        finally:
            clock.iteration_ends()

    training.train_step = timed_train_step


def worker(argv: list[str], out: str) -> int:
    """One rank: instrument once the plugin is set up, then run the launcher."""
    sys.path.insert(0, str(ROOT))
    from megatron_async import cpu
    from megatron_async.launch import main

    clock = Clock()
    setup = cpu.setup_device

    def setup_then_instrument(*args, **kwargs):
        result = setup(*args, **kwargs)
        _instrument(clock)
        return result

    cpu.setup_device = setup_then_instrument
    try:
        return main(argv)
    finally:  # also on sys.exit; not atexit, which a rank forked by the smoke test's warm launcher never runs
        Path(out, f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(clock.record()))


# --- the driver ------------------------------------------------------------------
def configs(layers: int) -> list[tuple]:
    """PP=1 and, at PP=2, m=4: Megatron's 1F1B and 2bw at the first (most even) split of
    bench/throughput/pipeline_throughput.py's balance run (odd depths count the loss as a layer)."""
    from bench.throughput.pipeline_throughput import balance_configs

    candidates = balance_configs(layers)
    first = lambda prefix: next(c for c in candidates if c[0].startswith(prefix))  # noqa: E731
    return [first("pp1_m4"), first("1f1b_"), first("2bw_")]


def run(model: dict, config: tuple, iters: int) -> list[dict]:
    from bench.throughput.pipeline_throughput import command

    name, pp, m, extra = config
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = command(model, pp, m, extra, iters, os.path.join(tmp, "stats"))
        at = cmd.index("megatron_async.launch")
        cmd[at:at + 1] = ["bench.throughput.stage_breakdown", "--worker", tmp]
        proc = start_torchrun(cmd, cwd=ROOT, env=env).wait(1800)
        if proc.returncode != 0:
            raise RuntimeError(f"{name} failed:\n{proc.stdout[-3000:]}")
        ranks = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]
    if len(ranks) != pp or any(r["iterations"] < 1 for r in ranks):
        raise RuntimeError(f"{name}: expected {pp} ranks with timed iterations, got {ranks}")
    return ranks


def shares(ranks: list[dict], m: int) -> dict:
    """Per-rank seconds per microbatch of each part, and the busy share."""
    out = []
    for r in ranks:
        it = r["elapsed"] / r["iterations"]
        busy = (r["forward"] + r["backward"] + r["step"]) / r["elapsed"]
        out.append(dict(forward=r["forward"] / r["iterations"] / m, backward=r["backward"] / r["iterations"] / m,
                        step=r["step"] / r["iterations"] / m, iteration=it / m, busy=busy))
    return {"ranks": out, "busy": statistics.fmean(r["busy"] for r in out)}


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        sys.exit(worker(argv[2:], argv[1]))
    from bench.throughput.pipeline_throughput import BALANCE_MODEL, QUICK_MODEL
    from bench.results import emit

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="tiny model, PP=1 and 2bw, one repeat")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    model = dict(QUICK_MODEL, layers=3) if args.quick else dict(BALANCE_MODEL, layers=args.layers)
    repeats, iters = (1, FIRST_TIMED_ITERATION + 4) if args.quick else (args.repeats, args.iters)
    chosen = [c for c in configs(model["layers"]) if not (args.quick and c[0].startswith("1f1b"))]
    runs: dict[str, list] = {}
    for r in range(repeats):
        for config in chosen:
            result = shares(run(model, config, iters), config[2])
            runs.setdefault(config[0], []).append(result)
            print(f"repeat {r + 1}/{repeats} {config[0]}: busy {100 * result['busy']:.1f}%", flush=True)
    pp1 = statistics.median(x["busy"] for x in runs["pp1_m4"])
    result = {
        "date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "model": model, "iters": iters, "repeats": repeats, "command": "python -m bench.throughput.stage_breakdown " + " ".join(argv),
        "runs": runs, "busy": {name: statistics.median(x["busy"] for x in v) for name, v in runs.items()},
    }
    result["efficiency_vs_pp1_busy"] = {name: b / pp1 for name, b in result["busy"].items() if name != "pp1_m4"}
    return emit(result, report(result), args.json)


def report(r: dict) -> str:
    lines = ["| configuration | rank | forward | backward | step | iteration | busy share | busy / PP=1's |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, repeats in r["runs"].items():
        best = min(repeats, key=lambda x: abs(x["busy"] - r["busy"][name]))  # the median repeat
        for i, rank in enumerate(best["ranks"]):
            eff = r["efficiency_vs_pp1_busy"].get(name)
            lines.append(f"| {name} | {i} | {rank['forward']:.4f} | {rank['backward']:.4f} | {rank['step']:.4f} | "
                         f"{rank['iteration']:.4f} | {100 * rank['busy']:.1f}% | "
                         + ("-" if eff is None or i else f"{100 * eff:.1f}%") + " |")
    return "Seconds per microbatch (step: per batch / m), median repeat:\n\n" + "\n".join(lines)


if __name__ == "__main__":
    main()

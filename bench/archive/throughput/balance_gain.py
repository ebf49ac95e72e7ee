"""The stage planner's predicted gain against the measured one, for a vocabulary-heavy GPT: a one-off
study, kept with its results (bench/archive/benchmarks_history.md).

    .venv/bin/python -m bench.archive.throughput.balance_gain [--rounds 6] [--iters 16] [--json PATH]
    .venv/bin/python -m bench.archive.throughput.balance_gain --pp 4 --split 4=8,11,12,1 --rounds 3  # a given split
    .venv/bin/python -m bench.archive.throughput.balance_gain --quick   # tiny model, PP=2, one round

A GPT of 32 layers whose output layer weighs many transformer layers (hidden 128,
vocabulary 32,768, sequence 128, micro-batch 2, untied) runs under 2bw at PP=2 (m=4)
and PP=4 (m=8) twice per round: Megatron's even split and the planner's split
(`megatron_async.planning.plan --json`: its "balance" entry gives the split, Megatron's
flags for it and the cost model's seconds per microbatch of every stage of both
splits), or with --split a split of one's own, priced by the same cost model. The two
alternate, even first in odd rounds and second in even rounds (even, planned, planned,
even, ...), so the machine's drift falls on both alike, and each run is timed inside
itself with bench/throughput/stage_breakdown.py's method: every rank times Megatron's
forward_step, backward_step, its optimizer step and its iterations from iteration 10
on. Each rank also adds up its own CPU time inside those functions: with PP=4 on 2
cores, or beside other jobs, a rank's wall time there includes waiting for a core, its
CPU time does not.

Reported per PP, each the median over rounds of the round's even / planned ratio:
- measured: time per iteration (what this machine gives), the slowest stage's busy
  time (wall) and the slowest stage's busy CPU time (what one core per stage would
  give: the planner's assumption);
- predicted: the cost model's slowest stage, even / planned;
- their relative difference (the target: within 10%).
A least-squares fit of every run's per-stage CPU seconds per microbatch to
layers x a layer + the first stage's own + the last stage's own says what a layer, the
embedding and the output layer with its loss cost here (passes and optimizer step, also
each alone), next to the cost model's terms.

Every run is a real `pretrain()` job (mock data, one CPU thread a rank). On 2 cores the
default (6 rounds, 16 iterations: 24 jobs) takes about 30 minutes with other test runs
sharing the machine; --rounds 4 takes two thirds of that.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.results import emit
from bench.throughput import stage_breakdown
from tests.support.launch import start_torchrun

ROOT = Path(__file__).resolve().parents[3]
MODEL = dict(layers=32, hidden=128, heads=4, vocab=32768, seq=128, mbs=2)
QUICK_MODEL = dict(layers=4, hidden=32, heads=4, vocab=4096, seq=16, mbs=2)
TWO_BW = ["--pipeline-schedule", "2bw"]
PIPELINES = [(2, 4), (4, 8)]  # (PP, m): m = 2p microbatches a batch


# --- inside each launched rank ---------------------------------------------------
class CpuClock(stage_breakdown.Clock):
    """stage_breakdown's clock that also adds up this thread's CPU time in each timed function
    (torch runs a rank's CPU math on the calling thread; gloo's transfers run on their own)."""

    def __init__(self):
        super().__init__()
        self.cpu = {name: 0.0 for name in self.totals}

    def timed(self, name, func):
        walled = super().timed(name, func)

        def wrapper(*args, **kwargs):
            t0 = time.thread_time()
            try:
                return walled(*args, **kwargs)
            finally:
                if self.started is not None:
                    self.cpu[name] += time.thread_time() - t0

        return wrapper

    def record(self) -> dict:
        return {**super().record(), "cpu": self.cpu}


def worker(argv: list[str], out: str) -> int:
    """One rank: stage_breakdown's worker with the CPU-time clock."""
    stage_breakdown.Clock = CpuClock
    return stage_breakdown.worker(argv, out)


# --- the driver ------------------------------------------------------------------
def training_flags(model: dict, pp: int, m: int, iters: int, stats_dir: str, extra=()) -> list[str]:
    """The job's torchrun command line (bench/throughput/pipeline_throughput.py's, under 2bw)."""
    from bench.throughput.pipeline_throughput import command

    return command(model, pp, m, TWO_BW + list(extra), iters, stats_dir)


def plan_balance(model: dict, pp: int, m: int, iters: int, split_flags: list[str] = ()) -> dict:
    """The planner's "balance" entry for this job (Megatron's even split, or the split
    `split_flags` give): the used and the best split, the cost model's seconds a microbatch
    of each stage of both, the best split's flags, the model's terms. Run as its own process:
    parsing Megatron's arguments sets global state."""
    with tempfile.TemporaryDirectory() as tmp:
        flags = training_flags(model, pp, m, iters, os.path.join(tmp, "stats"))
        flags = flags[flags.index("--gpt") + 1:] + list(split_flags)
        out = os.path.join(tmp, "plan.json")
        cmd = [sys.executable, "-m", "megatron_async.planning.plan", "--world-size", str(pp), "--json", out,
               "--", *flags]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
        if not os.path.exists(out):
            raise RuntimeError(f"plan failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
        found = json.loads(Path(out).read_text()).get("balance")
    if not found:
        raise RuntimeError("megatron_async.planning.plan --json wrote no 'balance' entry")
    return found


def run_job(model: dict, pp: int, m: int, extra: list, iters: int) -> list[dict]:
    """One pretrain() job under 2bw through this file's worker: each rank's raw record."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = training_flags(model, pp, m, iters, os.path.join(tmp, "stats"), extra)
        at = cmd.index("megatron_async.launch")
        cmd[at:at + 1] = ["bench.archive.throughput.balance_gain", "--worker", tmp]
        proc = start_torchrun(cmd, cwd=ROOT, env=env).wait(1800)
        if proc.returncode != 0:
            raise RuntimeError(f"PP={pp} {extra} failed:\n{proc.stdout[-3000:]}")
        ranks = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"), key=_rank_number)]
    if len(ranks) != pp or any(r["iterations"] < 1 for r in ranks):
        raise RuntimeError(f"PP={pp} {extra}: expected {pp} ranks with timed iterations, got {ranks}")
    return ranks


def _rank_number(path: Path) -> int:
    return int(path.stem[len("rank"):])


def summary(ranks: list[dict], m: int) -> dict:
    """stage_breakdown's per-rank seconds a microbatch, plus each rank's busy CPU seconds a
    microbatch (step amortised over m), and the run's time per iteration (slowest rank)."""
    out = stage_breakdown.shares(ranks, m)
    for r, row in zip(ranks, out["ranks"]):
        cpu = r["cpu"]
        row["cpu_busy"] = (cpu["forward"] + cpu["backward"] + cpu["step"]) / r["iterations"] / m
        row["cpu_passes"] = (cpu["forward"] + cpu["backward"]) / r["iterations"] / m
        row["wall_busy"] = row["forward"] + row["backward"] + row["step"]
    out["iteration"] = max(r["elapsed"] / r["iterations"] for r in ranks)
    out["slowest_wall_busy"] = max(row["wall_busy"] for row in out["ranks"])
    out["slowest_cpu_busy"] = max(row["cpu_busy"] for row in out["ranks"])
    out["raw"] = ranks
    return out


def gains(rounds: list[dict]) -> dict:
    """Median over rounds of even / planned for the three measures."""
    keys = {"iteration": "iteration", "slowest_busy_wall": "slowest_wall_busy",
            "slowest_busy_cpu": "slowest_cpu_busy"}
    per_round = {name: [r["even"][key] / r["planned"][key] for r in rounds] for name, key in keys.items()}
    return {"per_round": per_round, **{name: statistics.median(v) for name, v in per_round.items()}}


def fit_costs(runs: list[tuple[list[int], list[float]]]) -> dict:
    """Least squares over every stage of every run: seconds a microbatch = layers x a layer
    + the embedding's part (first stage) + the output layer and loss's part (last stage)."""
    import numpy as np

    rows, costs = [], []
    for layers, stage_costs in runs:
        for s, (n, cost) in enumerate(zip(layers, stage_costs)):
            rows.append([n, 1.0 if s == 0 else 0.0, 1.0 if s == len(layers) - 1 else 0.0])
            costs.append(cost)
    (layer, first, last), *_ = np.linalg.lstsq(np.array(rows), np.array(costs), rcond=None)
    fitted = np.array(rows) @ np.array([layer, first, last])
    return {"layer": float(layer), "first_extra": float(first), "last_extra": float(last),
            "first_extra_in_layers": float(first / layer), "last_extra_in_layers": float(last / layer),
            "max_residual_share": float(max(abs(f - c) / c for f, c in zip(fitted, costs)))}


def fitted_parts(per_round: list[dict], layouts: dict) -> dict:
    """fit_costs of the stages' CPU seconds a microbatch: all (passes + step / m), the passes
    alone, the optimizer step alone (per microbatch, as the cost model amortises it)."""
    parts = {"busy": lambda row: row["cpu_busy"], "passes": lambda row: row["cpu_passes"],
             "step": lambda row: row["cpu_busy"] - row["cpu_passes"]}
    return {part: fit_costs([(layouts[name][0], [get(row) for row in r[name]["ranks"]])
                             for r in per_round for name in r]) for part, get in parts.items()}


def model_in_layers(found: dict) -> dict:
    """The cost model's own terms in units of its layer (pass + step share)."""
    t = found["terms"]
    layer = t["layer_pass"] + t["layer_step"]
    return {name: value / layer for name, value in t.items()} | {"layer": layer}


def prediction(model: dict, pp: int, m: int, iters: int, split: list[int] | None) -> dict:
    """The planner's balance for the even split; with `split`, that split measured in place of
    the planner's (its predicted costs from the same cost model, as the plan's used split)."""
    from megatron_async.planning.balance import megatron_flags

    found = dict(plan_balance(model, pp, m, iters), source="planner")
    if split:
        flags = megatron_flags(split)
        given = plan_balance(model, pp, m, iters, flags)
        found = dict(found, planner_best=found["best"], best=given["used"], best_costs=given["used_costs"],
                     flags=flags, source="--split")
    return found


def measure_pipeline(model: dict, pp: int, m: int, rounds: int, iters: int, found: dict) -> dict:
    """Even and planned split (the planner's `found`) alternately, `rounds` times, with the
    planner's prediction beside."""
    layouts = {"even": (found["used"], []), "planned": (found["best"], found["flags"])}
    per_round = []
    for r in range(rounds):
        runs = {}
        for name in ("even", "planned") if r % 2 == 0 else ("planned", "even"):
            runs[name] = summary(run_job(model, pp, m, layouts[name][1], iters), m)
            print(f"PP={pp} round {r + 1}/{rounds} {name} {layouts[name][0]}: {runs[name]['iteration']:.3f} "
                  f"s/iteration, slowest stage busy {runs[name]['slowest_cpu_busy']:.4f} s CPU a microbatch",
                  flush=True)
        per_round.append(runs)
    measured = gains(per_round)
    predicted = max(found["used_costs"]) / max(found["best_costs"])
    return {
        "pp": pp, "m": m, "even": found["used"], "planned": found["best"], "flags": found["flags"],
        "planned_by": found["source"], "planner_best": found.get("planner_best", found["best"]),
        "predicted_costs": {"even": found["used_costs"], "planned": found["best_costs"]},
        "cost_model_terms": found["terms"], "cost_model_in_layers": model_in_layers(found),
        "predicted_gain": predicted, "measured_gain": measured,
        "difference": {name: predicted / measured[name] - 1
                       for name in ("iteration", "slowest_busy_wall", "slowest_busy_cpu")},
        "fitted_cpu_costs": fitted_parts(per_round, layouts), "rounds": per_round,
    }


def machine() -> dict:
    """What the numbers were measured on."""
    import torch

    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in (cpuinfo.read_text() if cpuinfo.exists() else "").splitlines()
             if line.startswith("model name")]
    cpu = names[0] if names else platform.processor()

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "cpu": cpu, "python": platform.python_version(),
            "torch": torch.__version__, "commit": commit or None, "load_average_at_start": os.getloadavg()}


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        sys.exit(worker(argv[2:], argv[1]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--iters", type=int, default=16, help="training iterations a job (timed from iteration 10)")
    parser.add_argument("--layers", type=int, default=MODEL["layers"])
    parser.add_argument("--pp", type=int, nargs="+", default=[pp for pp, _ in PIPELINES], help="pipelines to run")
    parser.add_argument("--split", action="append", default=[], metavar="PP=N,N,...",
                        help="measure this split of the layers in place of the planner's (e.g. 4=8,11,12,1)")
    parser.add_argument("--quick", action="store_true", help="tiny model, PP=2, one round")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    model = QUICK_MODEL if args.quick else dict(MODEL, layers=args.layers)
    rounds, iters = (1, stage_breakdown.FIRST_TIMED_ITERATION + 2) if args.quick else (args.rounds, args.iters)
    started = time.time()
    info = machine()
    pipelines = PIPELINES[:1] if args.quick else [(pp, m) for pp, m in PIPELINES if pp in args.pp]
    splits = {int(pp): [int(n) for n in layers.split(",")] for pp, layers in (s.split("=") for s in args.split)}
    plans = {pp: prediction(model, pp, m, iters, splits.get(pp)) for pp, m in pipelines}  # all before the first job
    results = {f"pp{pp}": measure_pipeline(model, pp, m, rounds, iters, plans[pp]) for pp, m in pipelines}
    result = {
        "date": datetime.date.today().isoformat(), **info, "model": model, "iters": iters, "rounds": rounds,
        "first_timed_iteration": stage_breakdown.FIRST_TIMED_ITERATION, "wall_minutes": (time.time() - started) / 60,
        "command": "python -m bench.archive.throughput.balance_gain " + " ".join(argv), "pipelines": results,
    }
    return emit(result, report(result), args.json)


def report(r: dict) -> str:
    """Markdown: per PP the splits, measured and predicted gains, and the fitted CPU costs."""
    lines = ["| PP, m | even | planned | iteration time gain | slowest busy (wall) | slowest busy (CPU) "
             "| predicted | predicted / measured (CPU) - 1 |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for p in r["pipelines"].values():
        g = p["measured_gain"]
        lines.append(f"| {p['pp']}, {p['m']} | {p['even']} | {p['planned']} | {g['iteration']:.3f} | "
                     f"{g['slowest_busy_wall']:.3f} | {g['slowest_busy_cpu']:.3f} | {p['predicted_gain']:.3f} | "
                     f"{100 * p['difference']['slowest_busy_cpu']:+.1f}% |")
    lines += ["", "| PP | fitted layer (s CPU / microbatch) | embedding, in layers | output layer + loss, in layers "
              "| cost model: embedding step, in layers | cost model: output layer + loss + its step, in layers |",
              "| --- | --- | --- | --- | --- | --- |"]
    for p in r["pipelines"].values():
        f, c = p["fitted_cpu_costs"]["busy"], p["cost_model_in_layers"]
        lines.append(f"| {p['pp']} | {f['layer']:.4f} | {f['first_extra_in_layers']:.2f} | "
                     f"{f['last_extra_in_layers']:.2f} | {c['embedding_step']:.2f} | "
                     f"{c['output_layer_and_loss'] + c['output_layer_step']:.2f} |")
    lines += ["", "Per stage, median over rounds: the cost model's microseconds a microbatch (reference cluster) "
              "and the measured CPU seconds a microbatch (passes + step / m):", "",
              "| PP | split | layers | predicted (us) | measured CPU (s) |", "| --- | --- | --- | --- | --- |"]
    for p in r["pipelines"].values():
        for name in ("even", "planned"):
            measured = [statistics.median(rnd[name]["ranks"][s]["cpu_busy"] for rnd in p["rounds"])
                        for s in range(p["pp"])]
            lines.append(f"| {p['pp']} | {name} | {p[name]} | "
                         f"{', '.join(f'{1e6 * c:.2f}' for c in p['predicted_costs'][name])} | "
                         f"{', '.join(f'{c:.4f}' for c in measured)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

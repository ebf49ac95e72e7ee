"""What pointing the weights at each node's version costs 2bw's combined steps, on the CPU.

    .venv/bin/python -m bench.overhead.node_switch_cost [--iters 16] [--repeats 2] [--json PATH]

With `--overlap-moe-expert-parallel-comm` 2bw runs every pass through Megatron's combined
step, and before each node of a plan runs (a layer has four a pass), the stash points
the weights the node may read at its microbatch's version (pipeline/combined_step.py).
A real 2bw run in Megatron's loop (EP=2 x PP=2 x DP=2 on 4 gloo ranks, MoE with the
all-to-all dispatcher, bf16, m = 4: tests/test_combined_steps_in_megatron_loop.py's
configuration, with 8 layers and 8 experts) is timed two ways, alternating:

- `node`: as the runtime runs: a node points its layer's weights and those outside every
  layer;
- `stage`: every node points all of the stage's weights.

Each rank times every `WeightStashManager.point_to` call that is not a no-op (in its
thread's CPU time: the ranks share the cores, and a switch is host work), and its whole
iterations (wall time), from iteration FIRST_TIMED on. Per mode and stage: switches an
iteration, the parameters each sets, their time an iteration and a switch, and their share
of the iteration. A switch costs a Python assignment a parameter it changes (and a
comparison a parameter it covers), so the share scales with the number of parameters, not
their size; on the CPU each assignment also goes through the CUDA emulation's function
mode, so the last line times one outside it.
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

from bench.results import emit

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the ranks run this file as their entry
    sys.path.insert(0, str(ROOT))

FIRST_TIMED = 4  # iterations before this one build the runner and fill the pipeline
OUT_ENV, MODE_ENV = "NODE_SWITCH_OUT", "NODE_SWITCH_MODE"
MODES = ("node", "stage")
MODEL = ["--num-layers", "8", "--num-experts", "8"]  # after the test's flags: argparse keeps the last


# --- inside each rank ---------------------------------------------------------------
_CLOCK = {"iteration": 0, "started": None, "elapsed": 0.0, "switch_s": 0.0, "switches": 0, "params_set": 0,
          "stage_params": 0, "stage": None}


def _instrument(mode: str) -> None:
    import megatron.training.training as training

    from megatron_async.pipeline import combined_step
    from megatron_async.stash.weight_stash import WeightStashManager

    point_to = WeightStashManager.point_to

    def timed_point_to(self, version, only=None):
        if version == self._pointed or _CLOCK["started"] is None:
            return point_to(self, version, only)
        t0 = time.thread_time()  # CPU time: four ranks share two cores, and a switch is host work
        try:
            return point_to(self, version, only)
        finally:
            _CLOCK["switch_s"] += time.thread_time() - t0
            _CLOCK["switches"] += 1
            _CLOCK["params_set"] += len(self.params) if only is None else len(only)
            _CLOCK["stage_params"] = len(self.params)

    WeightStashManager.point_to = timed_point_to
    if mode == "stage":
        init = combined_step.NodeAtVersion.__init__

        def whole_stage(self, *args, **kwargs):
            init(self, *args, **kwargs)
            self.reads = None  # point_to(version, None): every weight of the stage

        combined_step.NodeAtVersion.__init__ = whole_stage
    train_step = training.train_step

    def timed_train_step(*args, **kwargs):
        from megatron.core import parallel_state

        _CLOCK["stage"] = parallel_state.get_pipeline_model_parallel_rank()  # the groups are gone at the end
        _CLOCK["iteration"] += 1
        if _CLOCK["iteration"] == FIRST_TIMED:
            _CLOCK["started"] = time.perf_counter()
        try:
            return train_step(*args, **kwargs)
        finally:
            if _CLOCK["started"] is not None:
                _CLOCK["elapsed"] = time.perf_counter() - _CLOCK["started"]

    training.train_step = timed_train_step


def rank_main(argv: list[str]) -> int:
    from megatron_async import launch
    from megatron_async.megatron_lm.adapter.hooks import install

    install()  # the plugin's hooks first, so the timing wraps what Megatron calls
    _instrument(os.environ[MODE_ENV])
    try:
        return launch.main(argv)
    finally:
        rank = os.environ.get("RANK", "0")
        record = dict(_CLOCK, timed=_CLOCK["iteration"] - FIRST_TIMED + 1)
        Path(os.environ[OUT_ENV], f"rank{rank}.json").write_text(json.dumps(record))


# --- the driver ---------------------------------------------------------------------
def one_run(mode: str, iters: int, workdir: Path) -> list[dict]:
    from tests.support.loop_runs import run
    from tests.test_combined_steps_in_megatron_loop import FLAGS, OVERLAP

    out = workdir / f"{mode}_{time.monotonic_ns()}"
    out.mkdir()
    proc, _ = run(out, mode, 4, FLAGS + OVERLAP + MODEL + ["--train-iters", str(iters)],
                  module="bench.overhead.node_switch_cost", env={OUT_ENV: str(out), MODE_ENV: mode})
    if proc.returncode != 0:
        raise SystemExit(proc.stdout[-4000:])
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


def plain_assignment_us(params: int = 64, reps: int = 500) -> float:
    """CPU time of one `param.data = tensor` in this process, outside the CPU emulation (whose
    function mode the ranks' switches go through): what a switch costs a parameter on a GPU host."""
    import torch

    weights = [torch.nn.Parameter(torch.zeros(8, 8, dtype=torch.bfloat16)) for _ in range(params)]
    versions = [[torch.zeros(8, 8, dtype=torch.bfloat16) for _ in range(params)] for _ in range(2)]
    t0 = time.thread_time()
    for k in range(reps):
        for weight, data in zip(weights, versions[k % 2]):
            weight.data = data
    return 1e6 * (time.thread_time() - t0) / (reps * params)


def summarise(runs: dict) -> dict:
    """Per mode and stage: medians over the runs of each stage's ranks' per-iteration numbers."""
    out = {}
    for mode, per_run in runs.items():
        for stage in sorted({r["stage"] for ranks in per_run for r in ranks}):
            ranks = [r for ranks in per_run for r in ranks if r["stage"] == stage]
            med = lambda f: statistics.median(f(r) for r in ranks)  # noqa: E731
            out[f"{mode} stage {stage}"] = {
                "switches_per_iteration": med(lambda r: r["switches"] / r["timed"]),
                "params_per_switch": med(lambda r: r["params_set"] / max(r["switches"], 1)),
                "stage_params": ranks[0]["stage_params"],
                "switch_ms_per_iteration": med(lambda r: 1e3 * r["switch_s"] / r["timed"]),
                "us_per_switch": med(lambda r: 1e6 * r["switch_s"] / max(r["switches"], 1)),
                "iteration_ms": med(lambda r: 1e3 * r["elapsed"] / r["timed"]),
                "share": med(lambda r: r["switch_s"] / r["elapsed"]),
            }
    return out


def table(summary: dict) -> str:
    lines = ["| mode, stage | switches an iteration | parameters a switch covers (of the stage's) | switch time an iteration "
             "| a switch | iteration | share |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, s in summary.items():
        lines.append(f"| {name} | {s['switches_per_iteration']:.0f} | {s['params_per_switch']:.1f} "
                     f"({s['stage_params']}) | {s['switch_ms_per_iteration']:.2f} ms | {s['us_per_switch']:.1f} us "
                     f"| {s['iteration_ms']:.0f} ms | {100 * s['share']:.2f}% |")
    return "\n".join(lines)


def main() -> int:
    if os.environ.get(OUT_ENV):  # a rank of a run
        return rank_main(sys.argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json")
    opts = parser.parse_args()
    runs: dict = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(opts.repeats):
            for mode in MODES:
                runs[mode].append(one_run(mode, opts.iters, Path(tmp)))
    summary = summarise(runs)
    plain_us = plain_assignment_us()
    result = {"plain_assignment_us": plain_us, "date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
              "cpus": os.cpu_count(), "iters": opts.iters, "first_timed": FIRST_TIMED, "repeats": opts.repeats,
              "summary": summary, "runs": runs}
    emit(result, table(summary) + f"\na parameter's assignment outside the CPU emulation: {plain_us:.2f} us",
         opts.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

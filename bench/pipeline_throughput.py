"""Pipeline throughput on CPU: PP=1, Megatron's 1F1B (PP=2) and our 2BW (PP=2).

One script, one GPT, configurations run round-robin so machine noise hits all of
them alike. Each run reports steady-state seconds per microbatch: every rank
stamps the end of each iteration after a common barrier, and the rate is taken
between the end of the warm-up iterations and the last timed one on each rank
(the slower rank counts). Differencing per rank cancels the constant offset
between stages that 2BW keeps, without a barrier inside its flush-free pipeline.

A second kind of run times one forward, backward and optimizer step on each stage
(both stages at once, as in the pipeline) plus the one-way point-to-point latency,
and feeds them to the schedule simulator, so measured and simulated rates can be
compared.

    .venv/bin/python -m bench.pipeline_throughput [--repeats R] [--iters N] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a file: the rank functions must import as bench.*
    sys.path.insert(0, str(ROOT))

# (name, schedule, pipeline stages, microbatches per batch)
CONFIGS = [
    ("pp1", "no-pipelining", 1, 4),
    ("1f1b_m2", "1f1b", 2, 2),
    ("1f1b_m4", "1f1b", 2, 4),
    ("1f1b_m16", "1f1b", 2, 16),
    ("2bw_m2", "2bw", 2, 2),
    ("2bw_m4", "2bw", 2, 4),
]
FULL_MODEL = dict(num_layers=8, hidden_size=256, num_attention_heads=4, vocab_size=4096,
                  seq_length=128, micro_batch_size=4)
QUICK_MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64,
                   seq_length=16, micro_batch_size=2)
SIM_BATCHES = 8  # batches per simulated run; the simulator's rate uses the middle ones


def make_spec(model: dict, schedule: str, pp: int, m: int):
    from megatron_async.testing.tiny_gpt import TinyGPT

    return TinyGPT(pp=pp, schedule=schedule, global_batch_size=model["micro_batch_size"] * m,
                   clip_grad=0.0, **model)


# --- rank functions (run by run_distributed on gloo ranks, one thread each) -----------
def throughput_rank(rank: int, world_size: int, spec, warmup: int, iters: int) -> dict:
    """Run warmup + iters iterations; return the end time of each, from a common start."""
    import torch
    import torch.distributed as dist

    from megatron_async.forward_step import gpt_forward_step
    from megatron_async.pipeline.grad_stats import make_stage_local
    from megatron_async.pipeline.two_bw import TwoBWRunner
    from megatron_async.schedules.registry import get_forward_backward_func
    from megatron_async.testing.tiny_gpt import build, microbatch_getter, microbatches

    model, optimizer, _ = build(spec)
    m = spec.num_microbatches(world_size)
    total = warmup + iters
    if spec.schedule == "2bw":
        make_stage_local(optimizer, False)
        # One batch more than is run: the timed iterations end in steady state and
        # the cool-down runs untimed in finish().
        runner = TwoBWRunner(
            model, optimizer, m, total + 1,
            activation_shape=(spec.seq_length, spec.micro_batch_size, spec.hidden_size),
            dtype=torch.float32, forward_step_func=gpt_forward_step,
            get_microbatch=microbatch_getter(spec, m),
        )

        def step(it):
            assert runner.train_step(it)[1][0], "optimizer step skipped"
    else:
        forward_backward = get_forward_backward_func(spec.schedule)

        def step(it):
            for chunk in model:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            forward_backward(forward_step_func=gpt_forward_step, data_iterator=microbatches(spec, it),
                             model=model, num_microbatches=m, seq_length=spec.seq_length,
                             micro_batch_size=spec.micro_batch_size, forward_only=False)
            assert optimizer.step()[0], "optimizer step skipped"

    dist.barrier()
    stamps = [time.perf_counter()]
    for it in range(total):
        step(it)
        stamps.append(time.perf_counter())
    if spec.schedule == "2bw":
        runner.finish()
    return {"stamps": stamps, "m": m}


def stage_timing_rank(rank: int, world_size: int, spec, warmup: int, reps: int) -> dict:
    """Median forward and backward seconds of one microbatch and of one optimizer step on
    this stage, and the one-way p2p latency of an activation.

    All stages run at once (sharing the machine as in the pipeline) but exchange no
    data: stage s > 0 gets a random input, stages before the last a random output
    gradient. Each rep runs the batch's m microbatches and then the step, as the
    training loops do (a step between every two microbatches slows them by cooling
    the caches).
    """
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.utils import get_attr_wrapped_model

    from megatron_async.forward_step import gpt_forward_step
    from megatron_async.pipeline.grad_stats import make_stage_local
    from megatron_async.testing.tiny_gpt import build, microbatches

    model, optimizer, _ = build(spec)
    make_stage_local(optimizer, False)
    chunk = model[0]
    first = parallel_state.is_pipeline_first_stage()
    last = parallel_state.is_pipeline_last_stage()
    set_input = get_attr_wrapped_model(chunk, "set_input_tensor")
    batches = list(microbatches(spec, 0))
    shape = (spec.seq_length, spec.micro_batch_size, spec.hidden_size)
    times = {"fwd": [], "bwd": [], "opt": []}
    for i in range(warmup + reps):
        dist.barrier()
        for batch in batches:
            set_input(None if first else torch.randn(shape, requires_grad=True))
            t0 = time.perf_counter()
            output, loss_func = gpt_forward_step(iter([batch]), chunk)
            if last:
                loss_sum, num_tokens, _ = loss_func(output)
                output = loss_sum / num_tokens
            t1 = time.perf_counter()
            torch.autograd.backward(output, grad_tensors=None if last else torch.randn_like(output))
            t2 = time.perf_counter()
            if i >= warmup:
                times["fwd"].append(t1 - t0)
                times["bwd"].append(t2 - t1)
        t2 = time.perf_counter()
        chunk.finish_grad_sync()
        optimizer.step()
        optimizer.zero_grad()
        chunk.zero_grad_buffer()
        if i >= warmup:
            times["opt"].append(time.perf_counter() - t2)
    result = {k: statistics.median(v) for k, v in times.items()}
    result["stage"] = parallel_state.get_pipeline_model_parallel_rank()
    if world_size > 1:  # ping-pong an activation between ranks 0 and 1
        x, rtt = torch.randn(shape), []
        for i in range(2 + 10):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(x, 1)
                dist.recv(x, 1)
            elif rank == 1:
                dist.recv(x, 0)
                dist.send(x, 0)
            if i >= 2:
                rtt.append(time.perf_counter() - t0)
        result["p2p"] = statistics.median(rtt) / 2
    return result


# --- driver ----------------------------------------------------------------------------
def per_microbatch(ranks: list[dict], warmup: int, iters: int) -> float:
    """Steady-state seconds per microbatch: the slower rank's rate over the timed iterations."""
    return max((r["stamps"][warmup + iters] - r["stamps"][warmup]) / (iters * r["m"]) for r in ranks)


def sim_costs(two: list[dict]) -> dict:
    """The simulator's per-stage cost arguments from the PP=2 stage timings."""
    return dict(fwd=[s["fwd"] for s in two], bwd=[s["bwd"] for s in two],
                opt=[s["opt"] for s in two], p2p=two[0]["p2p"])


def simulated(stages: dict, m_pp1: int) -> dict:
    """Seconds per microbatch the simulator predicts for each config from stage timings."""
    from megatron_async.schedules.generators import generate
    from megatron_async.schedules.simulator import simulate

    one = stages["pp1"][0]
    out = {"pp1": one["fwd"] + one["bwd"] + one["opt"] / m_pp1}
    costs = sim_costs(stages["pp2"])
    for name, schedule, pp, m in CONFIGS:
        if pp == 2:
            # Megatron's optimizer all-reduces the grad norm over both stages at each
            # step (a collective); 2BW's optimizer is stage-local.
            result = simulate(generate(schedule, 2, m, SIM_BATCHES), sync_at_step=schedule == "1f1b", **costs)
            out[name] = 1.0 / result.throughput
    return out


def plot(stages: dict, directory: str) -> list[str]:
    """Simulated timelines of 1F1B and 2BW at m=4 with the measured stage costs."""
    from megatron_async.schedules.gantt import plot_gantt
    from megatron_async.schedules.generators import generate
    from megatron_async.schedules.simulator import simulate

    costs = sim_costs(stages["pp2"])
    os.makedirs(directory, exist_ok=True)
    paths = []
    for schedule in ("1f1b", "2bw"):
        result = simulate(generate(schedule, 2, 4, 3), sync_at_step=schedule == "1f1b", **costs)
        path = os.path.join(directory, f"bench_{schedule}_m4.png")
        paths.append(plot_gantt(result, path, title=f"{schedule}, p=2, m=4, measured stage costs (s)"))
    return paths


def ratios(t: dict, bound: float, sim: dict) -> dict:
    return {
        "simulated_2bw_m4_speedup_vs_1f1b_m4": sim["1f1b_m4"] / sim["2bw_m4"],
        "simulated_2bw_m4_speedup_vs_1f1b_m16": sim["1f1b_m16"] / sim["2bw_m4"],
        "2bw_m4_speedup_vs_1f1b_m4": t["1f1b_m4"] / t["2bw_m4"],  # target >= 1.25
        "2bw_m4_speedup_vs_1f1b_m16": t["1f1b_m16"] / t["2bw_m4"],  # target >= 1.0
        "2bw_m4_fraction_of_ideal": bound / t["2bw_m4"],  # 1.0 = PP=1 time halved
        "2bw_m2_fraction_of_ideal": bound / t["2bw_m2"],
    }


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5, help="round-robin passes over all configs (median)")
    p.add_argument("--iters", type=int, default=4, help="timed iterations per config and repeat")
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations before them")
    p.add_argument("--stage-reps", type=int, default=3, help="timed batches (of m=4) per stage-timing run")
    p.add_argument("--quick", action="store_true", help="tiny model, 2 iterations: a smoke test")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--plot-dir", help="write simulated timelines (bench_*_m4.png) here")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per distributed run")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.iters, args.warmup, args.stage_reps = 1, 2, 1, 1
    return args


def main(argv=None) -> dict:
    from megatron_async.testing.multiprocess import run_distributed

    bench = sys.modules.get("bench.pipeline_throughput")
    if bench is None:  # run as __main__: hand the ranks functions with an importable name
        import importlib

        bench = importlib.import_module("bench.pipeline_throughput")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    model = QUICK_MODEL if args.quick else FULL_MODEL
    command = " ".join([".venv/bin/python -m bench.pipeline_throughput", *argv])
    print(f"$ {command}", flush=True)
    start = time.time()
    info = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
        "loadavg_start": os.getloadavg(),
    }
    import torch

    info["torch"] = torch.__version__
    print(f"model {model}, fp32, dropout 0; warmup {args.warmup}, timed {args.iters} iterations, "
          f"{args.repeats} repeats", flush=True)

    samples = {name: [] for name, *_ in CONFIGS}
    stage_samples = {"pp1": [], "pp2": []}
    for rep in range(args.repeats):
        for name, schedule, pp, m in CONFIGS:
            spec = make_spec(model, schedule, pp, m)
            ranks = run_distributed(bench.throughput_rank, pp, spec, args.warmup, args.iters,
                                    timeout_s=args.timeout)
            samples[name].append(per_microbatch(ranks, args.warmup, args.iters))
            print(f"  repeat {rep}: {name:9s} {samples[name][-1]:.4f} s/microbatch", flush=True)
        for key, pp in (("pp1", 1), ("pp2", 2)):
            spec = make_spec(model, "no-pipelining" if pp == 1 else "1f1b", pp, 4)
            stage_samples[key].append(run_distributed(bench.stage_timing_rank, pp, spec, 1, args.stage_reps,
                                                      timeout_s=args.timeout))

    measured = {name: statistics.median(v) for name, v in samples.items()}
    stages = {key: [{k: statistics.median(run[s][k] for run in runs) for k in runs[0][s] if k != "stage"}
                    for s in range(len(runs[0]))]
              for key, runs in stage_samples.items()}
    m_pp1 = CONFIGS[0][3]
    sim = simulated(stages, m_pp1)
    bound = measured["pp1"] / 2
    info["loadavg_end"] = os.getloadavg()
    info["elapsed_s"] = time.time() - start
    results = {
        "command": command, "machine": info, "model": model, "warmup": args.warmup, "iters": args.iters,
        "repeats": args.repeats, "pp1_microbatches": m_pp1,
        "configs": {name: {"schedule": schedule, "pp": pp, "m": m, "s_per_microbatch": measured[name],
                           "samples": samples[name], "simulated_s_per_microbatch": sim[name]}
                    for name, schedule, pp, m in CONFIGS},
        "ideal_bound_s_per_microbatch": bound,
        "stage_bound_s_per_microbatch": max(s["fwd"] + s["bwd"] for s in stages["pp2"]),
        "stage_times": stages,
        "ratios": ratios(measured, bound, sim),
    }
    print(report(results), flush=True)
    if args.plot_dir:
        for path in plot(stages, args.plot_dir):
            print(f"wrote {path}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2))
        print(f"wrote {args.json}")
    return results


def report(r: dict) -> str:
    lines = ["", "| config | schedule | PP | m | measured s/microbatch | simulated s/microbatch | vs PP=1 |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    pp1 = r["configs"]["pp1"]["s_per_microbatch"]
    for name, c in r["configs"].items():
        lines.append(f"| {name} | {c['schedule']} | {c['pp']} | {c['m']} | {c['s_per_microbatch']:.4f} | "
                     f"{c['simulated_s_per_microbatch']:.4f} | {pp1 / c['s_per_microbatch']:.2f}x |")
    lines.append(f"| ideal bound | PP=1 / 2 | | | {r['ideal_bound_s_per_microbatch']:.4f} | | 2.00x |")
    lines.append(f"| stage bound | max stage fwd+bwd | | | {r['stage_bound_s_per_microbatch']:.4f} | | |")
    lines += ["", "| stage | forward s | backward s | optimizer step s |", "| --- | --- | --- | --- |"]
    for key, stages in r["stage_times"].items():
        for s, t in enumerate(stages):
            lines.append(f"| {key} stage {s} | {t['fwd']:.4f} | {t['bwd']:.4f} | {t['opt']:.4f} |")
    lines.append(f"\np2p latency (one activation, one way): {r['stage_times']['pp2'][0]['p2p'] * 1e3:.2f} ms")
    q = r["ratios"]
    lines += [
        "",
        f"2BW m=4 vs 1F1B m=4:  speedup {q['2bw_m4_speedup_vs_1f1b_m4']:.2f}x (target >= 1.25x; "
        f"simulated {q['simulated_2bw_m4_speedup_vs_1f1b_m4']:.2f}x; 1.25x is the limit at p=2, m=4 "
        f"with balanced stages and a free optimizer step)",
        f"2BW m=4 vs 1F1B m=16: speedup {q['2bw_m4_speedup_vs_1f1b_m16']:.2f}x (target >= 1.00x; "
        f"simulated {q['simulated_2bw_m4_speedup_vs_1f1b_m16']:.2f}x)",
        f"2BW m=4 reaches {q['2bw_m4_fraction_of_ideal']:.0%} of the ideal bound (m=2: "
        f"{q['2bw_m2_fraction_of_ideal']:.0%})",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()

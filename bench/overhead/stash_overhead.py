"""What the weight stash costs an iteration: plain training against a one-step delay.

    .venv/bin/python -m bench.overhead.stash_overhead [--cycles N] [--json PATH] [--quick]

One gloo process trains the benchmark GPT (8 layers, hidden 256, sequence 128,
micro-batch 4, m = 4) through Megatron-Core's no-pipelining schedule and optimizer,
and times whole iterations (forward-backward, gradient sync, step) of four ways
to run the same model, alternating every iteration (the order rotated each cycle),
so the machine's drift hits all of them alike:

- `plain`: no stash;
- `delay`: `--simulated-delay 1` as the runtime runs it: the stash points the
  parameters at the previous version and saves the live weights before each step,
  with no saved-tensor hooks (no step falls between a forward and its backward);
- `hooks`: the same with the saved-tensor hooks and the alias guard on every
  forward: what a 2bw forward whose backward follows a step pays;
- `hooks_noguard`: the hooks without the alias guard, to separate the guard's cost.

The ratio to `plain` is the median over cycles of each cycle's ratio. On a machine
whose pace drifts by 10% between iterations that ratio cannot resolve 1%, so the
stash's own costs are also timed directly (`breakdown`: the mean of the fastest
timings of one microbatch with and without hooks, of the weight copy a step makes,
and of repointing the parameters) and expressed as a share of a plain iteration.
Under 2bw only the warm-up forwards of the next batch take the `hooks` path
(p - 1 - s of a stage's m forwards per batch, none on the last stage).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from bench.results import emit

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the rank function must import as bench.overhead.stash_overhead
    sys.path.insert(0, str(ROOT))

MODES = ("plain", "delay", "hooks", "hooks_noguard")
FULL_MODEL = dict(num_layers=8, hidden_size=256, num_attention_heads=4, vocab_size=4096, seq_length=128,
                  micro_batch_size=4, global_batch_size=16)
QUICK_MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16,
                   micro_batch_size=2, global_batch_size=8)


def _iteration(model, optimizer, spec, iteration, stash, mode, forward_backward, num_micro):
    """One training iteration in `mode`; returns its wall time."""
    import contextlib

    from tests.support.forward_step import gpt_forward_step
    from tests.support.tiny_gpt import microbatches

    start = time.perf_counter()
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    if mode == "plain":
        stash.point_to(stash.newest)
        context, step_context = contextlib.nullcontext(), contextlib.nullcontext()
    else:
        stash.guard_aliases = mode != "hooks_noguard"
        context = stash.use(max(stash.newest - 1, 0), hooks=mode != "delay")
        step_context = stash.optimizer_step()
    with context:
        forward_backward(forward_step_func=gpt_forward_step, data_iterator=microbatches(spec, iteration),
                         model=model, num_microbatches=num_micro, seq_length=spec.seq_length,
                         micro_batch_size=spec.micro_batch_size, forward_only=False)
    with step_context:
        optimizer.step()
    return time.perf_counter() - start


def timing_rank(rank: int, world_size: int, spec, cycles: int, warmup: int) -> dict:
    """Runs in the one gloo process: each cycle runs one iteration of every mode, in
    an order rotated from cycle to cycle; returns each mode's time per cycle."""
    from megatron_async.schedules.registry import get_forward_backward_func
    from megatron_async.stash.weight_stash import WeightStashManager
    from tests.support.tiny_gpt import build

    model, optimizer, _config = build(spec)
    stash = WeightStashManager(model, depth=1)
    forward_backward = get_forward_backward_func("no-pipelining")
    num_micro = spec.num_microbatches(world_size)
    iteration = 0
    per_cycle = {mode: [] for mode in MODES}
    for cycle in range(-warmup, cycles):  # negative cycles: warm-up (allocations, first touch), not kept
        order = MODES[cycle % len(MODES):] + MODES[:cycle % len(MODES)]
        for mode in order:
            took = _iteration(model, optimizer, spec, iteration, stash, mode, forward_backward, num_micro)
            iteration += 1
            if cycle >= 0:
                per_cycle[mode].append(took)
    return {"per_cycle": per_cycle, "breakdown": breakdown(model, spec, stash)}


def _fastest(fn, repeats: int, keep: int = 5) -> float:
    """Mean of the `keep` fastest of `repeats` timings: deterministic work's cost,
    robust to a machine whose pace drifts by 10% or more from one call to the next."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.fmean(sorted(times)[:keep])


def _copy_per_parameter(stash) -> None:
    """The step's weight copy without `torch._foreach_copy_`: a copy a parameter, what the one call saves against."""
    for dst, src in zip(stash.slot_views()[0], stash._live):
        dst.copy_(src)


def breakdown(model, spec, stash, repeats: int = 30) -> dict:
    """The stash's own costs, timed directly: one microbatch's forward+backward with and
    without the saved-tensor hooks (alternating), the copy of the live weights a step
    makes, and repointing the parameters to a version."""
    import torch

    from tests.support.forward_step import gpt_forward_step
    from tests.support.tiny_gpt import microbatches

    batch = next(iter(microbatches(spec, 0)))
    saved = [0]

    def count(t):
        saved[0] += 1
        return t

    def forward_backward(hooks: bool, guard: bool = True):
        stash.guard_aliases = guard
        with stash.use(stash.newest, hooks=hooks):
            output, loss_func = gpt_forward_step(iter([batch]), model[0])
        loss_func(output)[0].backward()

    with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
        forward_backward(hooks=False)
    timings = {"plain": [], "hooks": [], "hooks_noguard": []}
    for _ in range(repeats):
        for mode, run in (("plain", lambda: forward_backward(False)), ("hooks", lambda: forward_backward(True)),
                          ("hooks_noguard", lambda: forward_backward(True, guard=False))):
            timings[mode].append(_fastest(run, 1, 1))
    microbatch = {mode: statistics.fmean(sorted(t)[:5]) for mode, t in timings.items()}
    # point_to before the copies: a copy overwrites the older version the swap points to
    point_to = _fastest(lambda: (stash.point_to(stash.newest - 1 if stash.newest else 0),
                                 stash.point_to(stash.newest)), repeats) / 2
    copies = {"foreach": [], "per_parameter": []}
    for _ in range(repeats):  # the step's copy against a copy a parameter, alternated
        copies["foreach"].append(_fastest(stash.copy_live_into_stash, 1, 1))
        copies["per_parameter"].append(_fastest(lambda: _copy_per_parameter(stash), 1, 1))
    return {
        "saved_tensors_per_forward": saved[0],
        "microbatch_s": microbatch,
        "point_to_s": point_to,
        "stash_copy_s": statistics.fmean(sorted(copies["foreach"])[:5]),
        "stash_copy_per_parameter_s": statistics.fmean(sorted(copies["per_parameter"])[:5]),
        "weight_bytes": stash.live_bytes(),
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=40, help="timed cycles (one iteration of every mode each)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed cycles first")
    parser.add_argument("--json", default=None)
    parser.add_argument("--quick", action="store_true", help="tiny model, 4 cycles (a smoke test)")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from tests.support.multiprocess import run_distributed
    from tests.support.tiny_gpt import TinyGPT

    model = QUICK_MODEL if args.quick else FULL_MODEL
    cycles = 4 if args.quick else args.cycles
    spec = TinyGPT(lr=1e-4, clip_grad=1.0, **model)
    (measured,) = run_distributed(timing_rank, 1, spec, cycles, args.warmup, timeout_s=7200)
    per_cycle, parts = measured["per_cycle"], measured["breakdown"]
    m = spec.num_microbatches(1)
    iteration = statistics.fmean(sorted(per_cycle["plain"])[:5])  # plain iteration, its fastest
    hook_cost = max(parts["microbatch_s"]["hooks"] - parts["microbatch_s"]["plain"], 0.0)
    estimate = {  # the stash's cost as a share of a plain iteration, from the direct timings
        "delay": (parts["stash_copy_s"] + 2 * parts["point_to_s"]) / iteration,
        "hooks_every_forward": (parts["stash_copy_s"] + 2 * parts["point_to_s"] + m * hook_cost) / iteration,
    }
    ratios = {mode: [t / p for t, p in zip(per_cycle[mode], per_cycle["plain"])] for mode in MODES}
    quartiles = {mode: statistics.quantiles(r, n=4) for mode, r in ratios.items()}
    result = {
        "command": "python -m bench.overhead.stash_overhead " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(), "model": model, "cycles": cycles,
        "s_per_iter": {mode: statistics.median(v) for mode, v in per_cycle.items()}, "per_cycle": per_cycle,
        "ratio_to_plain": {mode: statistics.median(r) for mode, r in ratios.items()},
        "ratio_quartiles": {mode: [q[0], q[2]] for mode, q in quartiles.items()},
        "breakdown": parts, "plain_iteration_fastest_s": iteration, "estimated_share": estimate,
    }
    return emit(result, report(result), args.json)


def report(r: dict) -> str:
    lines = [f"stash overhead, {r['cycles']} cycles of one iteration per mode "
             f"({r['model']['num_layers']} layers, hidden {r['model']['hidden_size']})",
             "| mode | s/iteration (median) | vs plain: median of per-cycle ratios | quartiles |",
             "| --- | --- | --- | --- |"]
    for mode in MODES:
        lo, hi = r["ratio_quartiles"][mode]
        lines.append(f"| {mode} | {r['s_per_iter'][mode]:.4f} | {100 * (r['ratio_to_plain'][mode] - 1):+.2f}% | "
                     f"{100 * (lo - 1):+.1f}% .. {100 * (hi - 1):+.1f}% |")
    b, mb = r["breakdown"], r["breakdown"]["microbatch_s"]
    lines += [
        "",
        f"direct timings (mean of the 5 fastest): one microbatch forward+backward {mb['plain']:.4f} s plain, "
        f"{mb['hooks']:.4f} s with hooks + guard, {mb['hooks_noguard']:.4f} s hooks alone "
        f"({b['saved_tensors_per_forward']} saved tensors); stash copy {1e3 * b['stash_copy_s']:.2f} ms for "
        f"{b['weight_bytes'] / 2**20:.1f} MiB (one copy a parameter: "
        f"{1e3 * b['stash_copy_per_parameter_s']:.2f} ms); point_to {1e3 * b['point_to_s']:.3f} ms",
        f"estimated share of a plain iteration ({r['plain_iteration_fastest_s']:.3f} s): "
        f"delay {100 * r['estimated_share']['delay']:.2f}%, hooks on every forward "
        f"{100 * r['estimated_share']['hooks_every_forward']:.2f}%",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()

"""What the weight stash costs an iteration: plain training against a one-step delay.

    .venv/bin/python -m bench.stash_overhead [--rounds R] [--iters N] [--json PATH] [--quick]

One gloo process trains the benchmark GPT (8 layers, hidden 256, sequence 128,
micro-batch 4, m = 4) through Megatron-Core's no-pipelining schedule and optimizer,
and times whole iterations (forward-backward, gradient sync, step) of four ways
to run the same model, round-robin in blocks of N iterations, so the machine's
drift hits all of them alike:

- `plain`: no stash;
- `delay`: `--simulated-delay 1` as the runtime runs it: the stash points the
  parameters at the previous version and saves the live weights before each step,
  with no saved-tensor hooks (no step falls between a forward and its backward);
- `hooks`: the same with the saved-tensor hooks and the alias guard on every
  forward: what a 2bw forward whose backward follows a step pays;
- `hooks_noguard`: the hooks without the alias guard, to separate the guard's cost.

The ratio to `plain` is the median over rounds of each round's median s/iteration.
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

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the rank function must import as bench.stash_overhead
    sys.path.insert(0, str(ROOT))

MODES = ("plain", "delay", "hooks", "hooks_noguard")
FULL_MODEL = dict(num_layers=8, hidden_size=256, num_attention_heads=4, vocab_size=4096, seq_length=128,
                  micro_batch_size=4, global_batch_size=16)
QUICK_MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16,
                   micro_batch_size=2, global_batch_size=8)


def _iteration(model, optimizer, spec, iteration, stash, mode, forward_backward, num_micro):
    """One training iteration in `mode`; returns its wall time."""
    import contextlib

    from megatron_async.forward_step import gpt_forward_step
    from megatron_async.testing.tiny_gpt import microbatches

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


def timing_rank(rank: int, world_size: int, spec, rounds: int, iters: int, warmup: int) -> dict:
    """Runs in the one gloo process: every mode for `iters` iterations per round."""
    from megatron_async.schedules.registry import get_forward_backward_func
    from megatron_async.testing.tiny_gpt import build
    from megatron_async.weight_stash import WeightStashManager

    model, optimizer, _config = build(spec)
    stash = WeightStashManager(model, depth=1)
    forward_backward = get_forward_backward_func("no-pipelining")
    num_micro = spec.num_microbatches(world_size)
    iteration = 0
    for mode in MODES:  # warm-up: allocations, first touch, every path once
        for _ in range(warmup):
            _iteration(model, optimizer, spec, iteration, stash, mode, forward_backward, num_micro)
            iteration += 1
    per_round = {mode: [] for mode in MODES}
    for r in range(rounds):
        order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]  # rotate who goes first
        for mode in order:
            times = []
            for _ in range(iters):
                times.append(_iteration(model, optimizer, spec, iteration, stash, mode, forward_backward,
                                        num_micro))
                iteration += 1
            per_round[mode].append(statistics.median(times))
    return per_round


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=6, help="timed iterations per mode and round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations per mode first")
    parser.add_argument("--json", default=None)
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 rounds (a smoke test)")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from megatron_async.testing.multiprocess import run_distributed
    from megatron_async.testing.tiny_gpt import TinyGPT

    model = QUICK_MODEL if args.quick else FULL_MODEL
    rounds = 2 if args.quick else args.rounds
    spec = TinyGPT(lr=1e-4, clip_grad=1.0, **model)
    (per_round,) = run_distributed(timing_rank, 1, spec, rounds, args.iters, args.warmup, timeout_s=7200)
    medians = {mode: statistics.median(v) for mode, v in per_round.items()}
    ratios = {mode: [t / p for t, p in zip(per_round[mode], per_round["plain"])] for mode in MODES}
    result = {
        "command": "python -m bench.stash_overhead " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(), "model": model, "rounds": rounds, "iters_per_round": args.iters,
        "s_per_iter": medians, "per_round": per_round,
        "ratio_to_plain": {mode: statistics.median(r) for mode, r in ratios.items()},
    }
    return emit(result, report(result), args.json)


def report(r: dict) -> str:
    lines = [f"stash overhead, {r['rounds']} rounds x {r['iters_per_round']} iterations per mode "
             f"({r['model']['num_layers']} layers, hidden {r['model']['hidden_size']})",
             "| mode | s/iteration (median) | vs plain (median of per-round ratios) |", "| --- | --- | --- |"]
    for mode in MODES:
        ratio = r["ratio_to_plain"][mode]
        lines.append(f"| {mode} | {r['s_per_iter'][mode]:.4f} | {100 * (ratio - 1):+.2f}% |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

"""megatron-async-simulate: validate and time a pipeline schedule, print its costs.

Example: megatron-async-simulate --schedule 2bw --pp 4 --microbatches 4 --batches 3 --plot 2bw.png
With --overlap-moe-expert-parallel-comm it simulates the lists the schedule runs with
Megatron's flag of that name (combined forward-backward steps, each costing --pair).
Costs are in arbitrary time units; --fwd/--bwd/--opt take one number or one per
stage, comma-separated (imbalanced stages). On schedules with two pieces per stage
(interleaved-1f1b, zbv) a cost is per pass of one piece.
"""

from __future__ import annotations

import argparse
import json
import sys

from megatron_async.schedules.registry import available_schedules, get_schedule, get_schedule_generator
from megatron_async.schedules.simulator import simulate, to_chrome_trace
from megatron_async.schedules.validator import ScheduleError

PROG = "megatron-async-simulate"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        self.exit(2, f"{self.prog}: error: {message}\n")


def _costs(text: str):
    values = [float(v) for v in text.split(",")]
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"costs must be >= 0, got {text!r}")
    return values[0] if len(values) == 1 else values


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def simulated_schedules() -> list[str]:
    """Every registered schedule with an action-list generator (`register_schedule` adds to them)."""
    return [name for name in available_schedules() if get_schedule(name).generator is not None]


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", required=True, choices=simulated_schedules())
    ap.add_argument("--pp", type=_positive, required=True, help="pipeline stages p")
    ap.add_argument("--microbatches", type=_positive, required=True, help="microbatches per batch m")
    ap.add_argument("--batches", type=_positive, default=3, help="batches (optimizer steps) n")
    ap.add_argument("--fwd", type=_costs, default=1.0, help="forward cost (or one per stage, comma-separated)")
    ap.add_argument("--bwd", type=_costs, default=2.0, help="backward cost (or one per stage)")
    ap.add_argument("--bwd-input", type=_costs, default=None,
                    help="input-gradient half of a split backward (zb-h1, zbv; default bwd / 2)")
    ap.add_argument("--bwd-weight", type=_costs, default=None,
                    help="weight-gradient half of a split backward (default bwd / 2)")
    ap.add_argument("--overlap-moe-expert-parallel-comm", action="store_true",
                    help="the lists the schedule runs with Megatron's flag of that name: combined "
                         "forward-backward steps (2bw, interleaved-1f1b)")
    ap.add_argument("--pair", type=_costs, default=None,
                    help="cost of a combined forward-backward step (or one per stage; default fwd + bwd, "
                         "nothing hidden)")
    ap.add_argument("--opt", type=_costs, default=0.0, help="optimizer step cost (or one per stage)")
    ap.add_argument("--p2p", type=float, default=0.0, help="point-to-point latency")
    ap.add_argument("--sync-at-step", action="store_true",
                    help="every optimizer step is a blocking collective over all stages")
    ap.add_argument("--sync-cost", type=float, default=0.0, help="cost of that collective")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--plot", metavar="PNG", help="write a Gantt chart")
    ap.add_argument("--trace", metavar="JSON", help="write a Chrome trace (chrome://tracing, Perfetto)")
    return ap


def _table(args, summary: dict) -> str:
    rows = [f"{args.schedule}: p={args.pp} m={args.microbatches} n={args.batches}  "
            f"makespan {summary['makespan']:g}  bubble {100 * summary['bubble_fraction']:.2f}%  "
            f"throughput {summary['throughput']:.4g} microbatches/unit",
            f"{'stage':>5} {'bubble%':>8} {'versions':>8} {'in-flight':>9} {'delay':>5}"]
    for s in range(args.pp):
        rows.append(f"{s:>5} {100 * summary['bubble_per_stage'][s]:>8.2f} "
                    f"{summary['max_weight_versions'][s]:>8} {summary['max_inflight_microbatches'][s]:>9} "
                    f"{summary['delay_per_stage'][s]:>5}")
    return "\n".join(rows)


def _flag_of(message: str) -> str:
    """The command-line flag a generator or simulator error is about."""
    for name in ("fwd", "bwd", "opt", "p2p", "pair"):
        if message.startswith(name):
            return f"--{name}"
    if "has no action lists with --overlap-moe-expert-parallel-comm" in message:
        return "--overlap-moe-expert-parallel-comm"
    return "--microbatches" if "microbatches" in message else "arguments"


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        spec = get_schedule(args.schedule)
        generator = get_schedule_generator(args.schedule, args.overlap_moe_expert_parallel_comm)
        schedule = generator(args.pp, args.microbatches, args.batches)
        result = simulate(schedule, fwd=args.fwd, bwd=args.bwd, opt=args.opt, p2p=args.p2p,
                          sync_at_step=args.sync_at_step, sync_cost=args.sync_cost,
                          bwd_input=args.bwd_input, bwd_weight=args.bwd_weight, pair=args.pair,
                          # a schedule our runtime trains: no more versions than it keeps
                          weight_versions=spec.weight_versions if spec.run is not None else None)
    except (ValueError, ScheduleError) as err:
        ap.exit(2, f"{PROG}: error: {_flag_of(str(err))}: {err}\n")
    summary = {"schedule": args.schedule, "pp": args.pp, "microbatches": args.microbatches,
               "batches": args.batches, **result.summary()}
    if args.plot:
        from megatron_async.schedules.gantt import plot_gantt

        plot_gantt(result, args.plot, title=f"{args.schedule} p={args.pp} m={args.microbatches} n={args.batches}")
    if args.trace:
        with open(args.trace, "w", encoding="utf-8") as fh:
            json.dump(to_chrome_trace(result), fh)
    print(json.dumps(summary) if args.json else _table(args, summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

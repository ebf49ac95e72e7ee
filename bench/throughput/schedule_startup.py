"""Schedule start-up: building the 2bw action lists before the first step.

    python -m bench.throughput.schedule_startup                 # p=8, m=16: 1k and 10k whole lists, 1k/10k/100k streamed
    python -m bench.throughput.schedule_startup --quick         # 100 and 1,000 iterations (what the smoke test runs)

"whole lists" are the 2bw generator's lists for every stage and the whole run
(gen_2bw.two_bw), whose cost grows with the run. "streamed" is what the runtime builds
instead: a TwoBWStream and the first batch's segment of every stage
(schedules/stream_2bw.py). Both are measured side by side in this process: wall
time and the Python heap's peak (tracemalloc). Whole lists at 100k iterations
(about 15 minutes and 12 GB here, by the linear growth the 1k and 10k rows show)
run only with --whole-100k.

Target: streamed start-up time and memory independent of --train-iters.
"""

from __future__ import annotations

import argparse
import json
import time
import tracemalloc


def _measure(build) -> tuple[float, float]:
    """(seconds, peak MB of the Python heap) of build()."""
    tracemalloc.start()
    begin = time.perf_counter()
    result = build()
    seconds = time.perf_counter() - begin
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del result
    return seconds, peak / 1e6


def whole_lists(p: int, m: int, n: int):
    from megatron_async.schedules.gen_2bw import two_bw

    return two_bw(p, m, n)


def streamed(p: int, m: int, n: int):
    from megatron_async.schedules.stream_2bw import TwoBWStream

    stream = TwoBWStream(p, m, n)
    return stream, [stream.segment(s, 0) for s in range(p)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="100 and 1,000 iterations")
    parser.add_argument("--whole-100k", action="store_true", help="also build whole lists for 100k iterations")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    p, m = args.pp, args.microbatches
    streamed(2, 1, 1), whole_lists(2, 1, 1)  # imports outside the measurements
    runs = [100, 1_000] if args.quick else [1_000, 10_000, 100_000]
    rows = []
    for n in runs:
        row = {"iterations": n}
        row["streamed_s"], row["streamed_mb"] = _measure(lambda: streamed(p, m, n))
        if n < 100_000 or args.whole_100k:
            row["whole_s"], row["whole_mb"] = _measure(lambda: whole_lists(p, m, n))
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n| iterations | whole lists: s | whole lists: MB | streamed: s | streamed: MB |  (p={p}, m={m})")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        whole = f"{r['whole_s']:.2f} | {r['whole_mb']:.0f}" if "whole_s" in r else "not run | not run"
        print(f"| {r['iterations']:,} | {whole} | {r['streamed_s']:.3f} | {r['streamed_mb']:.2f} |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"pp": p, "microbatches": m, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Muon's Newton-Schulz at Megatron's `--muon-fp32-matmul-prec` settings, timed side by side.

Megatron's default, `medium`, lets fp32 matmuls run in bf16. On a GPU that is the
fast path; on the CPU PyTorch emulates it, and the MoE sweep's Muon step was mostly
this. This times one orthogonalisation (emerging-optimizers' `newton_schulz`, 5
quintic steps, the call Megatron's Muon makes) of each weight shape of the sweep's
models at `medium` and `high`, interleaved, and reports the ratio and how far apart
the two results are:

    .venv/bin/python -m bench.overhead.muon_matmul_precision --json out/bench/muon_matmul_precision.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.results import emit

# (rows, cols) of the 2-D weights Muon orthogonalises in the sweep's models (QKV split in three)
SHAPES = {"dense / MoE attention": (128, 128), "MoE expert fc1": (256, 128), "MoE expert fc2": (128, 256),
          "dense fc1": (512, 128), "dense-large fc1": (1024, 256)}


def _time(fn, repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def measure(shape, repeats: int, rounds: int) -> dict:
    from emerging_optimizers.orthogonalized_optimizers.muon_utils import newton_schulz

    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    before = torch.get_float32_matmul_precision()
    times, out = {"medium": [], "high": []}, {}
    try:
        for _ in range(rounds):
            for prec in times:
                torch.set_float32_matmul_precision(prec)
                out[prec] = newton_schulz(x, steps=5, coefficient_type="quintic")
                times[prec].append(_time(lambda: newton_schulz(x, steps=5, coefficient_type="quintic"), repeats))
    finally:
        torch.set_float32_matmul_precision(before)
    medium, high = (statistics.median(times[p]) for p in ("medium", "high"))
    diff = (out["medium"] - out["high"]).norm() / out["high"].norm()
    return dict(shape=list(shape), medium_ms=1e3 * medium, high_ms=1e3 * high, ratio=medium / high,
                relative_difference=float(diff))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="two shapes, fewer repeats")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # as the sweep's runs (OMP_NUM_THREADS=1)
    shapes = dict(list(SHAPES.items())[:2]) if args.quick else SHAPES
    repeats, rounds = (2, 2) if args.quick else (5, 5)
    rows = {name: measure(shape, repeats, rounds) for name, shape in shapes.items()}
    lines = ["| weight | shape | medium (ms) | high (ms) | medium / high | relative difference |",
             "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {n} | {r['shape'][0]}x{r['shape'][1]} | {r['medium_ms']:.2f} | {r['high_ms']:.2f} | "
              f"{r['ratio']:.1f}x | {r['relative_difference']:.1e} |" for n, r in rows.items()]
    return emit({"rows": rows, "torch": torch.__version__, "threads": 1}, "\n".join(lines), args.json)


if __name__ == "__main__":
    main()

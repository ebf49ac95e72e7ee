"""Whether a rank's all-to-all kernels ran beside GEMMs on another stream, from its profiler trace.

`overlap(trace)` reads one rank's torch.profiler Chrome trace (tests/support/gpu/profile_entry.py):

- an all-to-all kernel is one whose launch (a CUDA runtime or driver event with its
  `correlation`) falls inside a host op named for an all-to-all (`c10d::alltoall_base_`,
  `nccl:all_to_all`, ...) on the same thread: NCCL names its kernels after its send/receive
  primitive, so the pipeline's point-to-point kernels look the same by name;
- a GEMM is a kernel named like cuBLAS's or CUTLASS's (gemm, cutlass, xmma, nvjet, cublas);
- their overlap is, for each all-to-all kernel, the time during which some GEMM on another
  stream of the same device ran (the union of the intersections).

A GEMM that runs while an all-to-all kernel runs does not wait on it: with Megatron's
combined step that is the other microbatch's compute (the model here has no shared experts).
A trace without CUDA kernels (the CPU dry run) gives zero all-to-all kernels.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ALL_TO_ALL_OP = re.compile(r"all_?to_?all", re.IGNORECASE)
GEMM_KERNEL = re.compile(r"gemm|cutlass|xmma|nvjet|cublas", re.IGNORECASE)
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")


def _events(trace) -> list[dict]:
    if isinstance(trace, (str, Path)):
        trace = json.loads(Path(trace).read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]


def _merged(intervals: list[tuple]) -> list[tuple]:
    out: list[list] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [tuple(i) for i in out]


def _stream(event: dict):
    return event.get("args", {}).get("stream", event.get("tid"))


def overlap(trace) -> dict:
    """The rank's all-to-all kernels, their time, the time GEMMs on other streams overlapped
    them, and how many overlapped at least one GEMM (times in microseconds)."""
    events = _events(trace)
    kernels = [e for e in events if e.get("cat") == "kernel"]
    ops = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation")
           and (ALL_TO_ALL_OP.search(e["name"]) or ALL_TO_ALL_OP.search(str(e.get("args", {}).get("Collective name", ""))))]
    by_thread: dict = {}
    for op in ops:
        by_thread.setdefault((op.get("pid"), op.get("tid")), []).append((op["ts"], op["ts"] + op["dur"]))
    launched = set()  # correlation ids of the launches inside an all-to-all op
    for e in events:
        correlation = e.get("args", {}).get("correlation")
        if e.get("cat") in LAUNCH_CATEGORIES and correlation is not None:
            if any(s <= e["ts"] <= end for s, end in by_thread.get((e.get("pid"), e.get("tid")), ())):
                launched.add(correlation)
    a2a = [k for k in kernels if k.get("args", {}).get("correlation") in launched]
    gemms = [k for k in kernels if GEMM_KERNEL.search(k["name"]) and not k["name"].lower().startswith("nccl")]
    total = overlapped = 0.0
    overlapping = 0
    for k in a2a:
        start, end = k["ts"], k["ts"] + k["dur"]
        total += k["dur"]
        cuts = [(max(start, g["ts"]), min(end, g["ts"] + g["dur"])) for g in gemms
                if g.get("pid") == k.get("pid") and _stream(g) != _stream(k)
                and g["ts"] < end and g["ts"] + g["dur"] > start]
        if cuts:
            overlapping += 1
            overlapped += sum(b - a for a, b in _merged(cuts))
    return {"all_to_all_kernels": len(a2a), "all_to_all_us": round(total, 1), "overlapped_us": round(overlapped, 1),
            "overlapped_share": round(overlapped / total, 4) if total else 0.0,
            "all_to_all_kernels_beside_a_gemm": overlapping, "gemm_kernels": len(gemms),
            "all_to_all_streams": sorted({str(_stream(k)) for k in a2a}),
            "gemm_streams": sorted({str(_stream(g)) for g in gemms})}


def overlaps(paths) -> dict:
    """`overlap` summed over ranks' traces."""
    per_rank = [overlap(p) for p in paths]
    total = sum(r["all_to_all_us"] for r in per_rank)
    hidden = sum(r["overlapped_us"] for r in per_rank)
    return {"all_to_all_kernels": sum(r["all_to_all_kernels"] for r in per_rank),
            "all_to_all_kernels_beside_a_gemm": sum(r["all_to_all_kernels_beside_a_gemm"] for r in per_rank),
            "all_to_all_us": round(total, 1), "overlapped_us": round(hidden, 1),
            "overlapped_share": round(hidden / total, 4) if total else 0.0, "per_rank": per_rank}

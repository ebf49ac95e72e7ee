"""What is alive on the GPU at a run's memory peak, read from torch's allocator trace.

max_memory_allocated gives the peak's size, not its parts. torch's caching allocator can
record every allocation and free with the Python stack that made it
(torch.cuda.memory._record_memory_history); replaying that trace finds the moment of the
peak and the blocks alive then, grouped by the code that allocated them. A plan's term
that is wrong shows as a group the plan has no term for, or one larger than its term.

Only the blocks allocated while recording are named; what was alive before (weights,
optimizer state) is `base_bytes`, read when recording starts. The trace records the sizes
asked for, the allocator's statistic the rounded block sizes: the replayed peak can read a
little below max_memory_allocated.
"""

from __future__ import annotations

from collections import defaultdict

MIB = 2**20
# files whose frames name the allocating code; torch's own modules say less than their caller
OWN_CODE = ("megatron/", "megatron_async/", "emerging_optimizers/")


def _short(filename: str) -> str:
    for marker in OWN_CODE:
        at = filename.rfind(marker)
        if at >= 0:
            return filename[at:]
    return filename.rsplit("/", 1)[-1]


def site(frames: list[dict], depth: int = 3) -> str:
    """The allocating code: the innermost `depth` frames in Megatron's or our own files
    (innermost first), or, where the autograd engine allocated with no Python frame
    (most of a backward pass), that fact."""
    own = [f for f in frames if any(m in f.get("filename", "") for m in OWN_CODE)]
    if not own:
        return "(no Python frame: autograd engine or C++)" if not frames else \
            " < ".join(f"{_short(f['filename'])}:{f['line']} {f['name']}" for f in frames[:depth])
    return " < ".join(f"{_short(f['filename'])}:{f['line']} {f['name']}" for f in own[:depth])


def replay(events: list[dict]) -> tuple[int, int]:
    """(peak bytes above the start, index of the event that reached it). torch lowers its
    allocated-bytes statistic when a free is requested (a block with pending stream uses is
    reused only later, but no longer counts as allocated)."""
    live: dict[int, int] = {}
    now = peak = 0
    at = -1
    for i, event in enumerate(events):
        action = event.get("action")
        if action == "alloc":
            now += event["size"] - live.get(event["addr"], 0)  # an address seen twice: a trace that wrapped
            live[event["addr"]] = event["size"]
            if now > peak:
                peak, at = now, i
        elif action == "free_requested":  # a block from before the trace counts by its event's size
            now -= live.pop(event["addr"], event["size"])
    return peak, at


def breakdown(events: list[dict], base_bytes: int, top: int = 30) -> dict:
    """The blocks alive at the peak, grouped by allocating site (MiB, largest first)."""
    peak, at = replay(events)
    live: dict[int, dict] = {}
    for event in events[:at + 1]:
        action = event.get("action")
        if action == "alloc":
            live[event["addr"]] = event
        elif action == "free_requested":
            live.pop(event["addr"], None)
    groups: dict[str, dict] = defaultdict(lambda: {"mib": 0.0, "blocks": 0, "sizes_mib": defaultdict(int)})
    by_size: dict[float, int] = defaultdict(int)
    for event in live.values():
        group = groups[site(event.get("frames", []))]
        mib = round(event["size"] / MIB, 3)
        group["mib"] += event["size"] / MIB
        group["blocks"] += 1
        group["sizes_mib"][mib] += 1
        by_size[mib] += 1
    ordered = sorted(groups.items(), key=lambda kv: -kv[1]["mib"])
    peak_event = events[at] if at >= 0 else {}
    return {
        "events": len(events),
        "base_mib": base_bytes / MIB,
        "peak_above_base_mib": peak / MIB,
        "peak_mib": (base_bytes + peak) / MIB,
        "peak_event_index": at,
        "peak_event_site": site(peak_event.get("frames", []), depth=8) if peak_event else None,
        "live_blocks": len(live),
        "groups": [{"site": name, "mib": round(g["mib"], 1), "blocks": g["blocks"],
                    "sizes_mib": {str(k): v for k, v in sorted(g["sizes_mib"].items(), reverse=True)}}
                   for name, g in ordered[:top]],
        "other_mib": round(sum(g["mib"] for _, g in ordered[top:]), 1),
        "blocks_by_size_mib": {str(k): v for k, v in sorted(by_size.items(), reverse=True) if k >= 1},
    }


def record_start(max_entries: int = 1_000_000) -> dict:
    """Start torch's allocator trace with Python stacks; returns what record_stop needs: the
    bytes allocated now and the allocator's peak so far."""
    import torch

    torch.cuda.synchronize()
    state = {"base_bytes": torch.cuda.memory_allocated(), "max_before": torch.cuda.max_memory_allocated(),
             "max_entries": max_entries}
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python",
                                             max_entries=max_entries)
    return state


def record_stop(state: dict) -> dict:
    """Stop the trace and return the peak's breakdown, with the allocator's peak before the
    traced span and after it beside it (equal to the replayed peak when the span holds the
    run's peak so far)."""
    import torch

    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    events = snapshot["device_traces"][torch.cuda.current_device()]
    out = breakdown(events, state["base_bytes"])
    out["max_allocated_before_mib"] = state["max_before"] / MIB
    out["max_allocated_mib"] = torch.cuda.max_memory_allocated() / MIB
    out["trace_full"] = len(events) >= state["max_entries"]  # a wrapped trace lost its first events
    return out

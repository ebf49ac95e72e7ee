"""`make test-gpu-ranks`: 2bw's multi-rank paths on real NCCL, several ranks on one GPU.

Skipped without CUDA, except as the CPU dry run (MEGATRON_ASYNC_GPU_RANKS_DRY_RUN=1,
`make test-gpu-ranks-dry`), where the same jobs run on gloo through the CPU emulation
of NCCL, to check the target itself before a GPU is at hand. Each case's result and wall
time go to $MEGATRON_ASYNC_GPU_REPORT/ranks.json (default out/gpu), for docs/benchmarks.md.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import time
from datetime import datetime
from pathlib import Path

import pytest

DRY_RUN_ENV = "MEGATRON_ASYNC_GPU_RANKS_DRY_RUN"


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - a broken torch is "no CUDA" here
        return False


def pytest_collection_modifyitems(config, items):
    if _cuda() or os.environ.get(DRY_RUN_ENV) == "1":
        return
    for item in items:
        item.add_marker(pytest.mark.skip(reason=f"needs a CUDA GPU (or {DRY_RUN_ENV}=1 for the CPU dry run)"))


class Record:
    """record(**fields) adds this case's numbers; record.launch(name, proc) adds one torchrun
    launch's wall time and where it went (Megatron's start-up lines, the first iterations)."""

    def __init__(self, entry: dict):
        self.entry = entry

    def __call__(self, **fields):
        self.entry.update(fields)

    def launch(self, name: str, proc) -> None:
        self.entry.setdefault("launches", []).append({"job": name, "wall_s": round(proc.wall_s, 1),
                                                      **launch_phases(proc.stdout or "", proc.started)})


STAMPS = {"megatron_initialized_s": "after megatron is initialized",
          "model_built_s": "after model, optimizer, and learning rate scheduler are built",
          "training_started_s": "before the start of training step",
          "training_done_s": "after training is done"}


def launch_phases(text: str, started: float) -> dict:
    """Where a launch's time went: seconds from its start (epoch `started`) to Megatron's
    own datetime lines, and its first iterations' times (ms)."""
    phases = {}
    for key, label in STAMPS.items():
        stamp = re.search(re.escape(f"[{label}] datetime: ") + r"([0-9: .-]+[0-9])", text)
        if stamp:
            phases[key] = round(datetime.fromisoformat(stamp.group(1)).timestamp() - started, 1)
    phases["iteration_ms"] = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", text)][:4]
    return phases


def _report(entry: dict) -> None:
    """Adds `entry` to ranks.json under a lock: pytest-xdist workers share the file."""
    folder = Path(os.environ.get("MEGATRON_ASYNC_GPU_REPORT", "out/gpu"))
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "ranks.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        path = folder / "ranks.json"
        entries = json.loads(path.read_text()) if path.exists() else []
        path.write_text(json.dumps(entries + [entry], indent=1))


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):  # the controller, once: a fresh report
        path = Path(os.environ.get("MEGATRON_ASYNC_GPU_REPORT", "out/gpu")) / "ranks.json"
        path.unlink(missing_ok=True)


@pytest.fixture
def record(request):
    """This case's Record; the report is rewritten after every case, so a run stopped from
    outside (a device lease's limit) still leaves the cases it finished."""
    entry = {"case": request.node.name, "device": "cuda" if _cuda() else "cpu (dry run)"}
    start = time.perf_counter()
    yield Record(entry)
    entry["wall_s"] = round(time.perf_counter() - start, 1)
    entry["outcome"] = dict(request.node.user_properties).get("outcome")
    _report(entry)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item.user_properties.append(("outcome", report.outcome))


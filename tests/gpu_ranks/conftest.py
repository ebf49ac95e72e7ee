"""`make test-gpu-ranks`: 2bw's multi-rank paths on real NCCL, several ranks on one GPU.

Skipped without CUDA, except as the CPU dry run (MEGATRON_ASYNC_GPU_RANKS_DRY_RUN=1,
`make test-gpu-ranks-dry`), where the same jobs run on gloo through the CPU emulation
of NCCL, to check the target itself before a GPU is at hand. Each case's result and wall
time go to $MEGATRON_ASYNC_GPU_REPORT/ranks.json (default out/gpu), for docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

DRY_RUN_ENV = "MEGATRON_ASYNC_GPU_RANKS_DRY_RUN"
_RESULTS: list = []


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


@pytest.fixture
def record(request):
    """record(**fields): this case's numbers, written with its outcome and wall time.

    The report is rewritten after every case, so a run stopped from outside (a device
    lease's limit) still leaves the cases it finished.
    """
    entry = {"case": request.node.name, "device": "cuda" if _cuda() else "cpu (dry run)"}
    start = time.perf_counter()
    yield entry.update
    entry["wall_s"] = round(time.perf_counter() - start, 1)
    entry["outcome"] = dict(request.node.user_properties).get("outcome")
    _RESULTS.append(entry)
    folder = Path(os.environ.get("MEGATRON_ASYNC_GPU_REPORT", "out/gpu"))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "ranks.json").write_text(json.dumps(_RESULTS, indent=1))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item.user_properties.append(("outcome", report.outcome))


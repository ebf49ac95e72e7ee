"""The GPU acceptance suite's record: environment, every test's outcome, results and timings.

A GPU run is rare and its numbers go into docs/benchmarks.md, so the suite writes
everything needed to quote it to one JSON file: the device and the torch / TE /
NCCL / CUDA versions (tests/support/gpu/env.py), each test's outcome and duration, and the
values tests hand to `record` (errors against tolerances, losses, s/iteration).
The directory is $MEGATRON_ASYNC_GPU_REPORT (default out/gpu); the file is
report.json there, and tests may write further files next to it.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

ENV_VAR = "MEGATRON_ASYNC_GPU_REPORT"
DEFAULT_DIR = "out/gpu"


def report_dir() -> Path:
    return Path(os.environ.get(ENV_VAR) or DEFAULT_DIR)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def write_json(path: Path, data) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str) + "\n", encoding="utf-8")
    return path


class GpuReport:
    """Collects during the session; `write()` puts it at report_dir()/report.json."""

    def __init__(self, environment: dict):
        self.data = {"started": _now(), "command": [sys.executable, *sys.argv], "environment": environment,
                     "tests": {}, "results": {}}

    def record(self, test_id: str, **values) -> None:
        self.data["results"].setdefault(test_id, {}).update(values)

    def outcome(self, test_id: str, outcome: str, duration_s: float, reason: str | None = None) -> None:
        entry = {"outcome": outcome, "duration_s": round(duration_s, 3)}
        if reason:
            entry["reason"] = reason
        self.data["tests"][test_id] = entry

    def write(self, directory: Path | None = None) -> Path:
        self.data["finished"] = _now()
        return write_json((directory or report_dir()) / "report.json", self.data)

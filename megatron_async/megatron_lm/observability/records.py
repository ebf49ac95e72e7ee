"""The metrics file's lines: strict JSON, and what a resumed run keeps of them."""

from __future__ import annotations

import json
import math
import os


def json_line(record: dict) -> str:
    """One line of strict JSON: a NaN or infinite number is written as null, since
    JSON has no such values and readers reject Python's `NaN`."""
    clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
    return json.dumps(clean, allow_nan=False) + "\n"


def read_records(path: str) -> list[dict]:
    """Every complete record of a metrics file (a line a crash cut short is skipped)."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def open_for_run(path: str, resumed_from: int):
    """The metrics file opened for appending: a fresh run empties it; a run resumed at
    iteration t keeps the records up to t and drops later ones (which a run that
    crashed after its last checkpoint left), so the file covers the run once."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    kept = []
    if resumed_from and os.path.exists(path):
        kept = [r for r in read_records(path) if r.get("iteration", 0) <= resumed_from]
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json_line(r) for r in kept)
    return open(path, "a", encoding="utf-8")

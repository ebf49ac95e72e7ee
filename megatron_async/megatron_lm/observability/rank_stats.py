"""`--rank-stats-dir`: each rank's own pace and memory, written without a collective."""

from __future__ import annotations

import os
from typing import Optional

from megatron_async.megatron_lm.observability.malloc_heap import heap_mb
from megatron_async.megatron_lm.observability.records import json_line


def rss_mb() -> float:
    """This process's resident set size in MB (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 1e6


class RankStats:
    """`DIR/rank<R>.jsonl`, one record per log interval: mean s/iter, RSS, malloc's bytes
    in use and free (malloc_heap.py: what tells a leak from kept free memory), extras.

    Every rank writes its own file and nothing is gathered, so a slow or growing
    rank shows up without a collective (which under 2bw would span stages).
    """

    def __init__(self, directory: Optional[str], rank: int, resumed_from: int = 0):
        self._file = None
        self._seconds: list[float] = []
        if directory:
            os.makedirs(directory, exist_ok=True)
            self._file = open(os.path.join(directory, f"rank{rank}.jsonl"), "a" if resumed_from else "w",
                              encoding="utf-8")

    def iteration(self, seconds: float) -> None:
        if self._file:
            self._seconds.append(seconds)

    def flush(self, iteration: int, **extra) -> None:
        """Write the record for the iterations since the last flush."""
        if not self._file or not self._seconds:
            return
        record = dict(iteration=iteration, s_per_iter=sum(self._seconds) / len(self._seconds),
                      rss_mb=round(rss_mb(), 1), **heap_mb(), **extra)
        self._seconds = []
        self._file.write(json_line(record))
        self._file.flush()

"""End a worker promptly when the launcher that started it dies.

torchrun's agent stops its workers when one fails or when it is stopped politely,
but a launcher killed outright (`kill -9`, an OOM kill, a lost ssh session) leaves
them training on as orphans, holding GPUs and writing checkpoints nobody asked
for. A daemon thread notices that the parent process changed (the orphan is
re-parented) and exits the worker.

Only active under torchrun (TORCHELASTIC_RUN_ID is set): a plain `python` run
whose shell exits (nohup, a detached job) is left alone.
"""

from __future__ import annotations

import os
import sys
import threading
import time

POLL_SECONDS = 1.0


def _watch(parent: int, poll_seconds: float) -> None:
    while True:
        time.sleep(poll_seconds)
        if os.getppid() != parent:
            rank = os.environ.get("RANK", "?")
            print(f"megatron-async: rank {rank}: the launcher (pid {parent}) is gone; exiting",
                  file=sys.stderr, flush=True)
            os._exit(1)


def exit_with_launcher(poll_seconds: float = POLL_SECONDS) -> bool:
    """Start the watch thread when launched by torchrun; returns whether it started."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    thread = threading.Thread(target=_watch, args=(os.getppid(), poll_seconds),
                              name="launcher-watch", daemon=True)
    thread.start()
    return True

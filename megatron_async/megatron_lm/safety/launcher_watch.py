"""End a worker promptly when the launcher that started it dies.

torchrun's agent stops its workers when one fails or when it is stopped politely,
but a launcher killed outright (`kill -9`, an OOM kill, a lost ssh session) leaves
them training on as orphans, holding GPUs and writing checkpoints nobody asked
for. A daemon thread notices that the parent process changed (the orphan is
re-parented) and exits the worker.

Only active under torchrun (TORCHELASTIC_RUN_ID is set): a plain `python` run
whose shell exits (nohup, a detached job) is left alone.

The same for a worker's own multiprocessing children: Megatron's torch_dist
checkpoint writer starts a `Manager` with the spawn method, which outlives a
worker killed with SIGKILL, and so does the resource tracker that waits for it,
holding hundreds of MB each until the node reboots. A spawned child re-imports the
worker's main module as `__mp_main__`; whatever the entry (`-m megatron_async.launch`,
the console scripts, a training script with the patched Megatron), that imports this
package, whose `__init__` calls `exit_with_parent` in a spawned child, which then
exits when its parent does.
"""

from __future__ import annotations

import os
import sys
import threading
import time

POLL_SECONDS = 1.0
_STARTED: dict = {}


def _watch(parent: int, poll_seconds: float, what: str = "launcher") -> None:
    while True:
        time.sleep(poll_seconds)
        if os.getppid() != parent:
            rank = os.environ.get("RANK", "?")
            print(f"megatron-async: rank {rank}: the {what} (pid {parent}) is gone; exiting",
                  file=sys.stderr, flush=True)
            os._exit(1)


def exit_with_launcher(poll_seconds: float = POLL_SECONDS) -> bool:
    """Start the watch thread when launched by torchrun; returns whether it started."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    if _STARTED.get("launcher") == os.getpid():  # once per process (launch and the hooks both ask)
        return True
    _STARTED["launcher"] = os.getpid()
    thread = threading.Thread(target=_watch, args=(os.getppid(), poll_seconds),
                              name="launcher-watch", daemon=True)
    thread.start()
    return True


def exit_with_parent(poll_seconds: float = 0.5) -> None:
    """In a multiprocessing child: exit once the parent process is gone. Called while
    the child imports the parent's main module, before multiprocessing has set up
    `parent_process()`, so the parent is the process id it was started by."""
    threading.Thread(target=_watch, args=(os.getppid(), poll_seconds, "parent process"), name="parent-watch",
                     daemon=True).start()

"""End the tests' forkserver when the pytest session that started it ends.

multiprocessing starts the warm forkserver (tests/support/multiprocess.py) as a process of
its own and leaves its end to the forkserver: it exits once every holder of its "alive"
pipe has gone, then unwinds an interpreter holding torch and Megatron-Core (about 1 GB),
seconds of CPU after pytest itself has exited, parented to init. Every pytest process
that ran ranks (the quick run, each xdist worker) has one. Ended here with SIGTERM and
waited for, it is gone before the session is. Imports nothing heavy, so a test can check
it in a light process.
"""

from __future__ import annotations

import os
import signal
from multiprocessing import forkserver


def forkserver_pid() -> int | None:
    """The pid of the forkserver this process started, if it started one."""
    return forkserver._forkserver._forkserver_pid


def stop_forkserver() -> int | None:
    """End the forkserver this process started and reap it; its pid, or None if there was
    none. Its ranks have ended with their tests (the harness waits for them), so it has
    nothing left to serve; a later job would start a new one."""
    pid = forkserver_pid()
    if pid is None:
        return None
    try:
        os.kill(pid, signal.SIGTERM)  # its own exit, after the alive pipe closes, takes seconds
    except ProcessLookupError:
        pass
    try:
        forkserver._forkserver._stop()  # closes our end of the alive pipe and waits for the pid
    except ChildProcessError:  # reaped already
        forkserver._forkserver._forkserver_pid = None
    return pid

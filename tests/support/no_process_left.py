"""Run a command (a pytest run of `make test`) and fail if any process it started outlives it.

    python -m tests.support.no_process_left COMMAND [ARGS...]

A test's ranks, their forkserver, a checkpoint writer's Manager: a process of the suite
that is still running once pytest has exited is parented to init and holds memory and
ports until someone finds it. The command runs with a token in its environment
($MEGATRON_ASYNC_TEST_RUN, new for each run), which every process it starts inherits:
forks carry it, and the suite's launches pass os.environ on. Other runs in the same
checkout carry another token or none, so they are never counted. Once the command has
exited, every process still carrying the token after a short grace (for one that is
exiting) is named with its pid, parent, memory and command line, then ended, and the
exit status is the command's, or 1 where the command passed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

TOKEN_ENV = "MEGATRON_ASYNC_TEST_RUN"
GRACE_S = 3.0
END_GRACE_S = 5.0


def carrying(token: str) -> list[int]:
    """The pids of the processes whose environment holds this run's token."""
    entry = f"\0{TOKEN_ENV}={token}\0".encode()
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            environ = (proc / "environ").read_bytes()
        except OSError:  # gone, or another user's
            continue
        if entry in b"\0" + environ:
            pids.append(int(proc.name))
    return pids


def describe(pid: int) -> str:
    """`pid N (parent P, M MB): command line`, from /proc."""
    proc = Path("/proc") / str(pid)
    try:
        cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        ppid, rss_mb = fields[1], int(fields[21]) * os.sysconf("SC_PAGE_SIZE") // 2**20
    except (OSError, IndexError, ValueError):
        return f"pid {pid} (gone)"
    return f"pid {pid} (parent {ppid}, {rss_mb} MB): {cmdline[:300]}"


def left_over(token: str, grace_s: float = GRACE_S) -> list[int]:
    """The processes still carrying the token once `grace_s` has passed without all of them exiting."""
    deadline = time.monotonic() + grace_s
    while (pids := carrying(token)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return pids


def end(pids: list[int]) -> None:
    """SIGTERM, then SIGKILL for those still there after END_GRACE_S."""
    for sig, wait_s in ((signal.SIGTERM, END_GRACE_S), (signal.SIGKILL, 0.0)):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while (pids := [p for p in pids if Path(f"/proc/{p}").exists() and not _zombie(p)]) \
                and time.monotonic() < deadline:
            time.sleep(0.1)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    token = uuid.uuid4().hex
    proc = subprocess.Popen(argv, env={**os.environ, TOKEN_ENV: token})
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ^C reaches the command too; its end is still checked
    code = proc.wait()
    pids = left_over(token)
    if not pids:
        return code
    print(f"error: {len(pids)} process(es) started by `{' '.join(argv)[:200]}` outlived it "
          f"(still running {GRACE_S:.0f} s after it exited); ending them:", file=sys.stderr)
    for pid in pids:
        print("  " + describe(pid), file=sys.stderr)
    end(pids)
    return code or 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

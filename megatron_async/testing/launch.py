"""Run the plugin's GPT entry in Megatron's loop under torchrun from tests and benchmarks, with a timeout."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Sequence


def torchrun_megatron(args: Sequence[str], nproc: int, timeout_s: float = 600, cwd=None,
                      warm: bool = True) -> subprocess.CompletedProcess:
    """Run the plugin's GPT entry in Megatron's own training loop on `nproc` local ranks.

    warm=True: ranks forked with Megatron imported (megatron_async.testing.warm_launch),
    what tests use; False: torchrun itself, what benchmarks that time a run use."""
    argv = ["--gpt", *map(str, args)]
    if warm:
        from megatron_async.testing.warm_launch import warm_run

        return warm_run("megatron_async.launch", argv, nproc, timeout_s, cwd=cwd)
    return _torchrun(["-m", "megatron_async.launch", *argv], nproc, timeout_s, cwd)


def _torchrun(entry: list, nproc: int, timeout_s: float, cwd) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *entry]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=cwd, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        raise TimeoutError(f"torchrun did not finish within {timeout_s:.0f} s:\n{out[-5000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None)


def finish_job(proc: subprocess.Popen, log, timeout_s: float = 300) -> tuple[int, str]:
    """Wait for a job started in its own session (`start_new_session=True`); past
    `timeout_s` kill its whole process group. Returns (exit code, the log file's text)."""
    from pathlib import Path

    try:
        proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    return proc.returncode, Path(log).read_text()

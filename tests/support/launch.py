"""Run the plugin's GPT entry in Megatron's loop under torchrun from tests and benchmarks, with a timeout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[2]  # the checkout, where `-m tests.support.MODULE` imports from


def torchrun_megatron(args: Sequence[str], nproc: int, timeout_s: float = 600, cwd=None,
                      warm: bool = True) -> subprocess.CompletedProcess:
    """Run the plugin's GPT entry in Megatron's own training loop on `nproc` local ranks.

    warm=True: ranks forked with Megatron imported (tests.support.warm_launch),
    what tests use; False: torchrun itself, what benchmarks that time a run use."""
    argv = ["--gpt", *map(str, args)]
    if warm:
        from tests.support.warm_launch import warm_run

        return warm_run("megatron_async.launch", argv, nproc, timeout_s, cwd=cwd)
    return _torchrun(["-m", "megatron_async.launch", *argv], nproc, timeout_s, cwd)


def _torchrun(entry: list, nproc: int, timeout_s: float, cwd) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *entry]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    return _TorchrunJob(cmd, cwd, env, None).wait(timeout_s)


BENCH_WARM_ENV = "MEGATRON_ASYNC_BENCH_WARM"


class _TorchrunJob:
    """A torchrun command in its own session; past its timeout the whole session is killed."""

    def __init__(self, cmd, cwd, env, log_path):
        self.cmd, self.log_path = cmd, log_path
        out = open(log_path, "w") if log_path else subprocess.PIPE
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd,
                                     start_new_session=True)
        if log_path:
            out.close()

    def wait(self, timeout_s: float) -> subprocess.CompletedProcess:
        try:
            out, _ = self.proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            out, _ = self.proc.communicate()
            out = Path(self.log_path).read_text(errors="replace") if self.log_path else out
            raise TimeoutError(f"torchrun did not finish within {timeout_s:.0f} s:\n{(out or '')[-5000:]}") from None
        out = Path(self.log_path).read_text(errors="replace") if self.log_path else out
        return subprocess.CompletedProcess(self.cmd, self.proc.returncode, out, None)


def start_torchrun(cmd: Sequence[str], cwd=None, env: dict | None = None, log_path=None):
    """Start a benchmark's `torchrun ... -m MODULE ARGS` (or `python -m torch.distributed.run
    ...`) command line; `.wait(timeout_s)` gives its exit code and output (also written to
    `log_path` when given).

    With $MEGATRON_ASYNC_BENCH_WARM=1, what the benchmarks' smoke tests set, the same
    MODULE and ARGS run on warm ranks instead (tests/support/warm_launch.py): the smoke tests
    check that a benchmark runs and reports, which torchrun's imports (some 20 s of CPU a
    launch) add nothing to. Benchmarks themselves, timed, keep torchrun."""
    cmd = [str(c) for c in cmd]
    if os.environ.get(BENCH_WARM_ENV) != "1":
        return _TorchrunJob(cmd, cwd, env, log_path)
    from tests.support.warm_launch import WarmJob

    at = cmd.index("-m", cmd.index("torch.distributed.run") + 1 if "torch.distributed.run" in cmd else 1)
    launcher = cmd[:at]
    nproc = next(int(a.split("=", 1)[1]) if "=" in a else int(launcher[i + 1])
                 for i, a in enumerate(launcher) if a.startswith("--nproc-per-node"))
    return WarmJob(cmd[at + 1], cmd[at + 2:], nproc, env=env, cwd=cwd, log_path=log_path, mock_data_cache=False)

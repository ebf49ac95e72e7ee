"""torchrun's job for tests, from ranks forked off one process that has imported Megatron.

A rank that starts from nothing spends about 7 s of CPU importing torch and
Megatron-Core (torch._dynamo, inductor and DTensor come with it) before it trains
a step; a suite that launches a couple of hundred ranks spends most of its time
there. Here each rank is forked from the forkserver of
`tests.support.multiprocess`, which has those imports done, and then runs
the entry module as `python -m MODULE ARGS` would, with torchrun's environment
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT, TORCHELASTIC_RUN_ID) and, as under
torchrun, the rendezvous store hosted by the launcher (multiprocess.host_store). Every rank is
still its own process with its own gloo rank; the entry (`megatron_async.launch`)
still installs the hooks and the CPU emulation itself.

Like torchrun: all ranks write to one output, the first rank that fails has the
others stopped, and the exit status is non-zero when any rank failed; the output
then ends with a line per rank that failed or was stopped, with its exit code. A
run past its timeout is killed and raises TimeoutError naming the ranks still running.
Tests of torchrun itself (a killed launcher, refusals under torchrun) keep torchrun.

`--mock-data` runs get Megatron's own `--data-cache-path` when the suite names a cache
folder ($MEGATRON_ASYNC_MOCK_DATA_CACHE, one per pytest worker: tests/conftest.py):
Megatron's mock dataset shuffles an index of millions of samples on every rank of
every run (about 0.5 s of CPU a rank), and with the cache its first run saves the
index and later runs load it. The index is the same either way, so is the data.
"""

from __future__ import annotations

import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Mapping, Sequence

from tests.support.multiprocess import AGENT_STORE_ENV, _context, host_store

STOP_GRACE_S = 5.0
MOCK_DATA_CACHE_ENV = "MEGATRON_ASYNC_MOCK_DATA_CACHE"


def with_mock_data_cache(argv: Sequence[str]) -> list[str]:
    """`argv` plus `--data-cache-path` for a `--mock-data` run that names no cache,
    when the suite set one (sequential runs only: two runs that build the same index
    at once would write the same files)."""
    argv = [str(a) for a in argv]
    cache = os.environ.get(MOCK_DATA_CACHE_ENV)
    if cache and "--mock-data" in argv and "--data-cache-path" not in argv:
        argv += ["--data-cache-path", cache]
    return argv


def _rank_main(module: str, argv: list[str], env: dict, log_path: str, cwd: str | None) -> None:
    os.setpgid(0, 0)  # the rank and what it starts: one group, which WarmJob.kill ends
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    os.environ.clear()
    os.environ.update(env)
    if cwd:
        os.chdir(cwd)
    sys.path.insert(0, os.getcwd())  # as `python -m` puts its working directory first
    import torch

    torch.set_num_threads(1)  # the forkserver's OpenMP read its thread count before this rank's env
    _fork_the_checkpoint_results_queue()
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def _fork_the_checkpoint_results_queue() -> None:
    """Megatron's torch_dist writer keeps its results in a `spawn` Manager, started at
    a rank's first save. Its server imports torch to unpickle the first results (about
    2 s of CPU per rank and run, a third of a short test run). Here the server is
    forked from the rank, with torch already imported; the queue and what passes
    through it are the same. Only these test ranks do this; torchrun jobs keep spawn.
    A spawned server exits with its rank (launcher_watch.exit_with_parent, from the
    package's import); the forked one is given the same watch, for a rank that leaves
    by os._exit (our failures after a save) without shutting its Manager down."""
    import multiprocessing
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_async.megatron_lm.safety.launcher_watch import exit_with_parent

    def forked_queue(mp_mode="fork"):
        if filesystem_async._results_queue is None:
            manager = SyncManager(ctx=multiprocessing.get_context("fork"))
            manager.start(initializer=exit_with_parent)
            filesystem_async._results_queue = manager.Queue()  # the queue keeps its manager
        return filesystem_async._results_queue

    filesystem_async.get_write_results_queue = forked_queue


def _stop(procs) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in procs:
        proc.join(timeout=max(0.1, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=10)


class WarmJob:
    """A job of warm ranks running in the background, as `torchrun ... &` would be: its
    ranks' pids, a signal to one rank, SIGKILL to the whole job (each rank leads its
    own process group, so its children go with it), and `wait` for its end."""

    def __init__(self, module: str, argv: Sequence[str], nproc: int, env: Mapping[str, str] | None = None,
                 cwd=None, log_path=None, mock_data_cache: bool = True, launcher_env: bool = True,
                 peers_exit_s: float = 0.0):
        ctx = _context()
        self.peers_exit_s = peers_exit_s
        self.exit_order: list[int] = []
        base = {**os.environ, **(env or {}), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self._store, self.port = None, None
        if launcher_env:  # torchrun's; without it, a plain `python -m` process (warm_python)
            self._store = host_store(nproc)  # as torchrun's agent: held by the launcher for the job
            port = self.port = self._store.port
            base.update(AGENT_STORE_ENV, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(nproc),
                        LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", TORCHELASTIC_RUN_ID=f"warm-{port}",
                        TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0")
        self.module, self.nproc = module, nproc
        self.argv = with_mock_data_cache(argv) if mock_data_cache else [str(a) for a in argv]
        self._temporary = log_path is None
        if self._temporary:
            fd, log_path = tempfile.mkstemp(prefix="warm_launch_", suffix=".log")
            os.close(fd)
        self.log = Path(log_path)
        self.log.write_text("")
        self.procs = [ctx.Process(target=_rank_main, name=f"rank{rank}",  # not daemonic: checkpointing forks
                                  args=(module, self.argv,
                                        dict(base, RANK=str(rank), LOCAL_RANK=str(rank)) if launcher_env else base,
                                        str(self.log), str(cwd) if cwd else None))
                      for rank in range(nproc)]
        for proc in self.procs:
            proc.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def running(self) -> bool:
        """True while every rank runs or none has failed yet (as torchrun: one failure ends the job)."""
        return any(p.is_alive() for p in self.procs) and not any(p.exitcode not in (None, 0) for p in self.procs)

    def signal(self, rank: int, sig: int) -> None:
        os.kill(self.procs[rank].pid, sig)

    def kill(self) -> None:
        """SIGKILL to every rank and its children, as a node failure would."""
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):  # a rank not yet leading its group
                proc.kill()
        for proc in self.procs:
            proc.join(timeout=10)
        self._store = None  # its server stops with the job

    def wait(self, timeout_s: float) -> subprocess.CompletedProcess:
        """The job's end: its exit code and its output, which ends with a line per rank
        that failed or was stopped. The exit code is that of the first rank seen to fail
        (torchrun's root cause); `exit_order` lists the ranks in the order they were seen
        to exit. Past `timeout_s` every rank is stopped and TimeoutError names the ranks
        still running. With `peers_exit_s`, the other ranks of a failed one get that long
        to exit on their own before they are stopped: for tests of what every rank does at
        its own exit, where ranks that stop together leave within milliseconds of each
        other and torchrun's immediate SIGTERM would decide by chance which got there."""
        procs = self.procs
        deadline = time.monotonic() + timeout_s
        try:
            while self.running():
                self._note_exits()
                if time.monotonic() > deadline:  # the finally below stops them
                    running = [r for r, p in enumerate(procs) if p.is_alive()]
                    raise TimeoutError(f"ranks {running} of {self.nproc} did not finish within {timeout_s:.0f} s:\n"
                                       + self.log.read_text(errors="replace")[-5000:])
                time.sleep(0.05)
            peers_deadline = min(deadline, time.monotonic() + self.peers_exit_s)
            while any(p.is_alive() for p in procs) and time.monotonic() < peers_deadline:
                self._note_exits()
                time.sleep(0.05)
        finally:
            self._note_exits()
            stopped = [r for r, p in enumerate(procs) if p.is_alive()]
            _stop(procs)
            self._store = None  # its server stops with the job
            out = self.log.read_text(errors="replace")
            if self._temporary:
                self.log.unlink(missing_ok=True)
        codes = [p.exitcode for p in procs]
        for rank, code in enumerate(codes):
            if code != 0:
                why = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
                out += f"warm_launch: rank {rank} of {self.nproc} {'stopped' if rank in stopped else 'failed'} ({why})\n"
        failed = [codes[r] for r in self.exit_order if codes[r] != 0 and r not in stopped]
        returncode = next((c for c in failed if c > 0), 1) if failed else 0
        return subprocess.CompletedProcess([sys.executable, "-m", self.module, *self.argv], returncode, out, None)

    def _note_exits(self) -> None:
        """Add the ranks that have exited since the last look to `exit_order` (ties: by rank)."""
        self.exit_order += [r for r, p in enumerate(self.procs) if r not in self.exit_order and not p.is_alive()]


def warm_run(module: str, argv: Sequence[str], nproc: int, timeout_s: float, env: Mapping[str, str] | None = None,
             cwd=None, peers_exit_s: float = 0.0) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node NPROC -m MODULE ARGV` with warm ranks."""
    return WarmJob(module, argv, nproc, env=env, cwd=cwd, peers_exit_s=peers_exit_s).wait(timeout_s)


def warm_python(module: str, argv: Sequence[str], timeout_s: float,
                env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGV` as one warm process, without torchrun's environment: for
    the one-process checks of many command lines (tests/support/refusals.py), which would
    otherwise spend most of their time importing Megatron."""
    return WarmJob(module, argv, 1, env=env, mock_data_cache=False, launcher_env=False).wait(timeout_s)

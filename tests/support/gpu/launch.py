"""Launch GPU runs for the acceptance suite: torchrun over NCCL, always with a timeout.

The CPU suite forks warm gloo ranks (warm_launch.py); on GPUs every rank must
start its own CUDA context, so runs go through torchrun itself. A run past its
timeout has its whole process group killed (torchrun and every rank), so a hung
NCCL collective cannot outlive its test; the error names the ranks that had already
exited, which the others were likely waiting for.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Mapping, Sequence

ROOT = Path(__file__).resolve().parents[3]  # the checkout: the plugin and tests/support, both importable from it

# Collectives and kernels that give the same result run after run (NCCL's ring
# all-reduce, TE without its non-deterministic attention kernels, a fixed cuBLAS
# workspace), for runs whose losses are compared with each other.
DETERMINISTIC_ENV = {"NCCL_ALGO": "Ring", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
                     "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def subprocess_env(extra: Mapping[str, str] | None = None) -> dict:
    """This environment, with the checkout importable and unbuffered output."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(PYTHONUNBUFFERED="1", CUDA_DEVICE_MAX_CONNECTIONS="1", OMP_NUM_THREADS="4")
    env.update(extra or {})
    return env


def ranks_running(session: int) -> list[int]:
    """The RANKs of the live processes of a session (Linux /proc; [] elsewhere): at a
    timeout, the ranks that are not among them are the ones that died first."""
    return sorted(set(rank_pids(session)))


def rank_pids(session: int) -> dict[int, int]:
    """RANK -> pid of the live processes of a session, or descended from its leader (torchrun
    may start its workers in sessions of their own), that carry a RANK: torchrun's workers
    (the lowest pid of a RANK: processes a worker starts inherit its RANK)."""
    table = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, pgrp, session, ...
            if fields[0] not in ("Z", "X"):
                table[int(entry.name)] = (int(fields[1]), int(fields[3]))
        except (OSError, ValueError, IndexError):
            continue
    mine = {pid for pid, (_ppid, sid) in table.items() if sid == session}
    grew = True
    while grew:
        more = {pid for pid, (ppid, _sid) in table.items() if ppid in mine and pid not in mine}
        mine |= more
        grew = bool(more)
    ranks: dict[int, int] = {}
    for pid in sorted(mine, reverse=True):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ranks.update((int(v[5:]), pid) for v in environ if v.startswith(b"RANK=") and v[5:].isdigit())
    return ranks


def _ranks_line(session: int, nproc: int | None) -> str:
    """'; ranks still running ...; exited before it ...' for a launch of `nproc` ranks, else ''."""
    if nproc is None:
        return ""
    running = ranks_running(session)
    gone = [r for r in range(nproc) if r not in running]
    return (f"; ranks still running at the timeout: {running}; exited before it: {gone}"
            + (" (look at these first: the others are likely waiting for them)" if gone and running else ""))


def run_with_timeout(cmd: Sequence[str], timeout_s: float, env: Mapping[str, str] | None = None,
                     cwd=None, nproc: int | None = None) -> subprocess.CompletedProcess:
    """Run `cmd` in its own session; past `timeout_s` (or when interrupted) kill the session,
    then raise, naming which of its `nproc` ranks were still running and which had exited.
    The result carries stdout and stderr together, its start (epoch) in `.started` and its
    wall time in `.wall_s`."""
    started, start = time.time(), time.perf_counter()
    proc = subprocess.Popen(list(map(str, cmd)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=subprocess_env(env), cwd=cwd or ROOT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        ranks = _ranks_line(proc.pid, nproc)
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        raise TimeoutError(f"{' '.join(map(str, cmd[:6]))} ... did not finish within {timeout_s:.0f} s{ranks}:\n"
                           f"{out[-5000:]}") from None
    except BaseException:  # interrupted (Ctrl-C, pytest-timeout): leave no rank running
        os.killpg(proc.pid, 9)
        proc.wait()
        raise
    result = subprocess.CompletedProcess(list(cmd), proc.returncode, out, None)
    result.started, result.wall_s = started, time.perf_counter() - start
    return result


def torchrun_gpt(args: Sequence[str], nproc: int, timeout_s: float, env: Mapping[str, str] | None = None,
                 cwd=None, module: str = "megatron_async.launch") -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node NPROC -m MODULE --gpt ARGS` on this node's first
    NPROC GPUs (Megatron binds rank r to GPU r), NCCL by Megatron's default. MODULE: the
    launcher, or tests.support.step_end_entry for a negative control's switches."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", module, "--gpt", *map(str, args)]
    return run_with_timeout(cmd, timeout_s, env=env, cwd=cwd, nproc=nproc)


def run_module(module: str, args: Sequence[str], timeout_s: float,
               env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS` in a fresh interpreter, with a timeout."""
    return run_with_timeout([sys.executable, "-m", module, *map(str, args)], timeout_s, env=env)


def read_metrics(path) -> list[dict]:
    """The records of a `--metrics-json` file (one JSON object a line)."""
    from megatron_async.megatron_lm.observability.records import read_records

    return read_records(str(path))


def train_losses(records: list[dict]) -> list[float | None]:
    """The training loss of each iteration, in order (None where it was not finite)."""
    return [r["lm_loss"] for r in records if "lm_loss" in r]


def iteration_seconds(records: list[dict], skip: int) -> list[float]:
    """Seconds per iteration after the first `skip` iterations (start-up, autotuning)."""
    return [r["s_per_iter"] for r in records
            if "lm_loss" in r and r.get("s_per_iter") is not None and r["iteration"] > skip]


def tail(proc: subprocess.CompletedProcess, chars: int = 5000) -> str:
    return (proc.stdout or "")[-chars:]

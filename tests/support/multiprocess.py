"""Run a function on N real gloo ranks from pytest, failing fast and never hanging.

Each rank is a separate process (from a forkserver that has already imported
torch and Megatron-Core, so a test does not pay the ~10 s import per rank) with
one CPU thread, CUDA emulation active and a gloo process group on a free port.
The first rank to raise fails the test with its own traceback; a run that
exceeds its timeout fails naming the ranks still running. Either way every
rank is killed before the call returns, so no process outlives its test.
"""

from __future__ import annotations

import copy
import io
import multiprocessing as mp
import os
import random
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch

# Modules the forkserver imports once; children fork from it with these loaded.
_PRELOAD = [
    "torch",
    "torch.distributed",
    "megatron.core.parallel_state",
    "megatron.core.models.gpt",
    "megatron.core.distributed",
    "megatron.core.optimizer",
    "megatron.core.pipeline_parallel",
    "megatron_async.cpu",
    "tests.support.warm_imports",
]

DEFAULT_TIMEOUT_S = float(os.environ.get("MEGATRON_ASYNC_TEST_TIMEOUT", "300"))


class RankError(RuntimeError):
    """A rank raised: the message holds its rank and traceback."""


class RanksTimedOut(TimeoutError):
    """Some ranks neither finished nor raised within the timeout."""


def _ephemeral_low() -> int:
    """Where the kernel's ephemeral port range starts."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(attempts: int = 100) -> int:
    """A port for a rendezvous store, below the kernel's ephemeral range.

    A port the kernel hands out (bind to 0) is free only until the store binds it, and
    meanwhile any other process's connection or gloo pair can be given the same
    ephemeral port (EADDRINUSE, seen with two pytest workers). Outside that range only
    an explicit bind can take it; the random choice (not seeded by tests) keeps two
    workers apart."""
    low = min(_ephemeral_low(), 32768)
    if low < 2048:  # (almost) every port is ephemeral here: the kernel's choice is all there is
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]
    rng = random.SystemRandom()
    for _ in range(attempts):
        port = rng.randrange(max(1024, low - 16384), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("", port))  # every address, as the store listens
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below the ephemeral range after {attempts} tries")


def host_store(world_size: int):
    """A job's rendezvous store, hosted by the process that launches its ranks, as
    torchrun's agent hosts it: bound at once to a port the kernel picks and held from
    before any rank starts until the job ends. A port that is picked free, let go and
    bound again by rank 0 can meanwhile be picked by another job: two jobs of two pytest
    workers met on one port, one failing with EADDRINUSE and the other hanging. The
    ranks connect as clients (AGENT_STORE_ENV)."""
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)


# torch's env:// rendezvous then makes every rank a client of the launcher's store (torchrun sets the same)
AGENT_STORE_ENV = {"TORCHELASTIC_USE_AGENT_STORE": "True"}

_CTX = None


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(_PRELOAD)
    return _CTX


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _rank_main(fn, rank, world_size, port, args, kwargs, queue, timeout_s):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
        **AGENT_STORE_ENV,
    )
    try:
        torch.set_num_threads(1)
        from megatron_async import cpu

        cpu.activate()
        torch.distributed.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
        )
        result = fn(rank, world_size, *args, **kwargs)
        queue.put((rank, "ok", _dumps(result)))
    except BaseException:  # noqa: BLE001 - any failure must reach the parent
        queue.put((rank, "error", traceback.format_exc()))
        return
    # Ranks that finished wait for their peers before tearing down the group, so a
    # fast rank does not break a slow rank's last collective.
    try:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    except Exception:  # noqa: BLE001 - a failed peer is reported by the parent
        pass


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on `world_size` gloo ranks.

    `fn` must be importable (a module-level function). Returns the ranks' return
    values in rank order; raises RankError or RanksTimedOut otherwise.
    """
    ctx = _context()
    queue = ctx.Queue()
    store = host_store(world_size)
    port = store.port
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, rank, world_size, port, args, kwargs, queue, timeout_s),
            name=f"rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                pending = sorted(set(range(world_size)) - set(results))
                raise RanksTimedOut(
                    f"ranks {pending} of {world_size} did not finish within {timeout_s:.0f} s"
                )
            try:
                rank, status, payload = queue.get(timeout=min(remaining, 1.0))
            except Exception:  # queue.Empty: check for ranks that died silently
                dead = [
                    r for r, p in enumerate(procs)
                    if r not in results and not p.is_alive() and p.exitcode not in (0, None)
                ]
                if dead:
                    codes = {r: procs[r].exitcode for r in dead}
                    raise RankError(f"rank(s) {dead} died without a report (exit codes {codes})")
                continue
            if status == "error":
                raise RankError(f"rank {rank} of {world_size} failed:\n{payload}")
            results[rank] = _loads(payload)
        for proc in procs:
            proc.join(timeout=max(5.0, deadline - time.monotonic()))
        return [results[r] for r in range(world_size)]
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(timeout=10)
        queue.close()
        del store  # the store's server stops with the job


_SHARED_RUNS: dict = {}


def shared_run(fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    """`run_distributed` of the same entry and arguments once per test process: for the
    runs that several tests compare against (a reference, a twin). Training runs are
    deterministic (fixed seeds, fp32, gloo), so a second run would repeat the first; each
    caller gets its own copy. Only for comparisons between different arguments: a test
    that checks a run against a rerun of itself must call run_distributed."""
    key = (fn.__module__, fn.__qualname__, world_size, repr(args), repr(sorted(kwargs.items())))
    if key not in _SHARED_RUNS:
        _SHARED_RUNS[key] = run_distributed(fn, world_size, *args, **kwargs)
    return copy.deepcopy(_SHARED_RUNS[key])

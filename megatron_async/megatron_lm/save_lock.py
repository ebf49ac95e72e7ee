"""One writer per `--save`.

Two jobs saving into one directory replace each other's checkpoints and both exit 0
(two submissions of one script, a requeued job beside its own zombie). Before
training, global rank 0 takes an exclusive `flock` on `--save`/.megatron_async_writer
and writes its job into it (host, pid, start time, job id); every rank learns the
outcome, so a second live job is refused on every rank, naming the first. The lock
belongs to a live process: the kernel drops it when that process dies, so a
requeue after `kill -9` takes it at once. Before each save every rank reads the file
again; if it names another job (the file was removed and taken while this job ran,
or a file system without coherent locks let two in), this job stops before the save,
naming the job that took it.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import time
from typing import Optional

from megatron_async.megatron_lm.side_state import CheckpointStateError

LOCK_NAME = ".megatron_async_writer"
_HELD: dict = {}  # save directory -> (fd, record) while this process holds its lock


class SaveLockError(CheckpointStateError):
    """Another live job writes (or took over) this run's --save."""


def job_id() -> str:
    """What every rank of one job shares and another job does not: torchrun's run id
    (one per launch), else the rendezvous address, with Slurm's job id when there is one."""
    run = os.environ.get("TORCHELASTIC_RUN_ID") or (
        f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}")
    slurm = os.environ.get("SLURM_JOB_ID")
    return f"{run} (Slurm job {slurm})" if slurm else run


def _describe(owner: Optional[dict]) -> str:
    if not owner:
        return "a job that has not written its name yet"
    return (f"job {owner.get('job')} on host {owner.get('host')}, pid {owner.get('pid')}, "
            f"started {owner.get('started')}")


def _read(path: str, tries: int = 20) -> Optional[dict]:
    for _ in range(tries):  # the holder writes its record right after taking the lock
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
            if text.strip():
                return json.loads(text)
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    return None


def take(save: str) -> Optional[str]:
    """Take the lock of `save` for this process; None, or why another job holds it."""
    import fcntl

    if save in _HELD:
        return None
    os.makedirs(save, exist_ok=True)
    path = os.path.join(save, LOCK_NAME)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return (f"--save {save} is being written by another live job ({_describe(_read(path))}); two jobs saving "
                "into one directory replace each other's checkpoints. Stop that job, or choose another --save")
    record = {"job": job_id(), "host": socket.gethostname(), "pid": os.getpid(),
              "started": datetime.datetime.now().isoformat(timespec="seconds")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)
    os.fsync(fd)
    _HELD[save] = (fd, record)
    return None


def take_on_every_rank(save: str) -> None:
    """Rank 0 takes the lock; every rank raises SaveLockError if it could not."""
    import torch.distributed as dist

    problem = [take(save) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(problem, src=0)
    if problem[0]:
        raise SaveLockError(f"megatron-async: {problem[0]}")


def check_before_save(save: str, iteration: int) -> None:
    """Every rank, before a save: the lock file still names this job."""
    owner = _read(os.path.join(save, LOCK_NAME), tries=1)
    if owner is None or owner.get("job") != job_id():
        raise SaveLockError(
            f"megatron-async: --save {save} was taken over while this job ran, by {_describe(owner)}; this job "
            f"stops before saving iteration {iteration} so that neither job replaces the other's checkpoints")

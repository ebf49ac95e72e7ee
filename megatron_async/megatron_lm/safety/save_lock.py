"""One writer per `--save`.

Two jobs saving into one directory replace each other's checkpoints and both exit 0
(two submissions of one script, a requeued job beside its own zombie). Before
training, global rank 0 takes an exclusive `flock` on `--save`/.megatron_async_writer
and writes its job into it (host, pid, start time, job id); every rank learns the
outcome, so a second live job is refused on every rank, naming the first. The lock
belongs to a live process: the kernel drops it when that process dies, so a
requeue after `kill -9` takes it at once. Before each save every rank reads the file
again and the ranks agree on what they read, so either every rank saves or none; if it
names another job (the file was removed and taken while this job ran, or a file system
without coherent locks let two in), the job stops before the save, naming the job that
took it.

On the file systems clusters use: a file system that refuses `flock` (Lustre mounted
`noflock`: ENOSYS; NFS without lock support: ENOLCK) is refused before training, naming
its error and the way out. A requeue of the same Slurm job whose previous run held the
lock on a node that died waits for the lock (Lustre and NFSv4 keep a lost node's lock
until its lease expires, 90-100 s or more), bounded by MEGATRON_ASYNC_SAVE_LOCK_WAIT_S
(default 300), saying so. Processes forked from the holder (DataLoader workers, a
fork-based checkpoint writer) close their copy of the lock, so it ends with the holder.
Node-local locks (Lustre `localflock`, NFS `local_lock=flock`, BeeGFS by default) let a
second node take a lock the first still holds: the holder touches its record every
HEARTBEAT_S seconds, and a job that gets the lock but finds a record of another host
touched within STALE_S is refused, naming it (a requeue of the same Slurm job waits for
the record to go stale instead). The check before each save stays as a second guard.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import time
from typing import Optional

from megatron_async.megatron_lm.checkpoint.side_files import CheckpointStateError

LOCK_NAME = ".megatron_async_writer"
WAIT_ENV = "MEGATRON_ASYNC_SAVE_LOCK_WAIT_S"
HEARTBEAT_S = 10.0  # how often the holder touches its record
STALE_S = 3 * HEARTBEAT_S  # a record untouched this long belongs to no live holder
_HELD: dict = {}  # save directory -> (fd, record) while this process holds its lock


def _close_in_child() -> None:
    """A forked child shares the holder's open file, and with it the lock, which would then
    outlive the holder; the child closes its copy (the holder's lock is unchanged)."""
    for fd, _record in _HELD.values():
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


os.register_at_fork(after_in_child=_close_in_child)


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
    waited = False
    deadline = time.monotonic() + float(os.environ.get(WAIT_ENV, "300"))
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            owner = _read(path)
            if _same_slurm_job_elsewhere(owner) and time.monotonic() < deadline:
                if not waited:
                    print(f"megatron-async: --save {save} is locked by an earlier run of this Slurm job on host "
                          f"{owner.get('host')}; waiting up to {os.environ.get(WAIT_ENV, '300')} s for its lock "
                          "(a lost node's lock lasts until the file system's lease for it expires)", flush=True)
                    waited = True
                time.sleep(1.0)
                continue
            os.close(fd)
            return (f"--save {save} is being written by another live job ({_describe(owner)}); two jobs saving "
                    "into one directory replace each other's checkpoints. Stop that job, or choose another --save")
        except OSError as err:
            os.close(fd)
            import errno

            name = errno.errorcode.get(err.errno, str(err.errno))
            return (f"--save {save}: its file system refuses flock ({name}: {err.strerror}), which keeps two jobs "
                    "from saving into one directory (Lustre mounted with noflock, NFS without lock support). Mount "
                    "it with flock (Lustre: -o flock), or choose a --save on a file system that has it")
    while True:  # the lock is ours on this node; is another node's holder alive (a node-local lock)?
        owner = _read(path, tries=1)
        if not _alive_elsewhere(path, owner):
            break
        if _same_slurm_job_elsewhere(owner) and time.monotonic() < deadline:
            time.sleep(1.0)
            continue
        os.close(fd)
        return (f"--save {save} is being written by another live job ({_describe(owner)}, its record touched "
                f"{time.time() - os.path.getmtime(path):.0f} s ago), although this node got the lock: the file "
                "system's locks are node-local (Lustre localflock, NFS local_lock=flock, BeeGFS), so two jobs "
                "could both write. Stop that job, choose another --save, or mount with global locks")
    record = {"job": job_id(), "host": socket.gethostname(), "pid": os.getpid(),
              "started": datetime.datetime.now().isoformat(timespec="seconds")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)
    os.fsync(fd)
    _HELD[save] = (fd, record)
    _heartbeat(path)
    return None


def _alive_elsewhere(path: str, owner: Optional[dict]) -> bool:
    """A record of another host, touched within STALE_S: its holder is alive there."""
    if not owner or owner.get("host") == socket.gethostname():
        return False
    try:
        return time.time() - os.path.getmtime(path) < STALE_S
    except OSError:
        return False


def _heartbeat(path: str) -> None:
    """Touch the record every HEARTBEAT_S seconds while this process lives (a daemon thread)."""
    import threading

    def beat():
        while True:
            time.sleep(HEARTBEAT_S)
            try:
                os.utime(path)
            except OSError:
                pass

    threading.Thread(target=beat, name="megatron-async-save-lock", daemon=True).start()


def _same_slurm_job_elsewhere(owner: Optional[dict]) -> bool:
    """The holder is an earlier run of this Slurm job (a requeue keeps SLURM_JOB_ID) on another host."""
    slurm = os.environ.get("SLURM_JOB_ID")
    return bool(owner and slurm and f"(Slurm job {slurm})" in str(owner.get("job"))
                and owner.get("host") != socket.gethostname())


def take_on_every_rank(save: str) -> None:
    """Rank 0 takes the lock; every rank raises SaveLockError if it could not."""
    import torch.distributed as dist

    problem = [take(save) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(problem, src=0)
    if problem[0]:
        raise SaveLockError(f"megatron-async: {problem[0]}")


def check_before_save(save: str, iteration: int) -> None:
    """Every rank, before a save: the lock file still names this job. The ranks agree on
    it (Megatron's save is a collective of every rank anyway), so a read that fails on one
    rank stops all of them before anyone writes, not that rank alone in the middle."""
    import torch.distributed as dist

    owner = _read(os.path.join(save, LOCK_NAME), tries=5)
    problem = None
    if owner is None or owner.get("job") != job_id():
        problem = (f"megatron-async: --save {save} was taken over while this job ran, by {_describe(owner)}; this "
                   f"job stops before saving iteration {iteration} so that neither job replaces the other's "
                   "checkpoints")
    if dist.is_initialized() and dist.get_world_size() > 1:
        seen: list = [None] * dist.get_world_size()
        dist.all_gather_object(seen, problem)
        problem = next((p for p in seen if p), None)
    if problem:
        raise SaveLockError(problem)

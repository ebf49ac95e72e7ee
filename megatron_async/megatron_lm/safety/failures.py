"""How a rank reports a failure: one line of ours, an exit code, and torchrun's error file.

torchrun names the failure with the earliest timestamp (whole seconds; a tie goes to
the lowest rank). A rank with the cause records its error and leaves only once that
second has passed, so every rank torchrun then stops, or that lost its connection to
it, fails later and is not named instead; one that lost a peer also waits a moment
before it fails, for the same reason.

Used by the launcher (megatron_async.launch) and, for entries without it (a training
script with the patched Megatron), by the `sys.excepthook` the hooks install.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Optional

PEER_LOSS_GRACE_S = 2.5


class FlagError(ValueError):
    """A flag Megatron accepts but the chosen schedule cannot honour; the message names it
    (raised by adapter/flags.py, reported here in one line)."""

_PEER_LOSS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "NCCL communicator was aborted")


def our_line(err: BaseException) -> Optional[tuple[str, int]]:
    """(our one line, the exit code) for a refusal or stop of ours, else None."""
    from megatron_async.megatron_lm.checkpoint.side_files import CheckpointStateError
    from megatron_async.pipeline.non_finite import NonFiniteError

    rank = os.environ.get("RANK", "0")
    if isinstance(err, FlagError):
        return f"megatron-async: error: {err}", 2
    if isinstance(err, CheckpointStateError):
        return f"{err} (rank {rank})", 2
    if isinstance(err, NonFiniteError):
        return f"megatron-async: rank {rank}: stopped: {err}", 3
    return None


def report(line: str) -> None:
    """Our one line, last on this rank's stderr and in torchrun's failure summary."""
    _write_line(line)
    record_error(line)


def _write_line(line: str) -> None:
    """One write for the line and its newline: ranks that share an output (torchrun's
    console, a job log) each append whole lines; print's two writes let two ranks'
    refusals run together on one line."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def other_failure(err: BaseException) -> None:
    """Any other exception: a lost peer waits (the rank with the cause is named first);
    anything else is recorded as this rank's failure. Once per exception: the launcher
    handles it and re-raises it, and the excepthook then sees the same one."""
    if getattr(err, "_megatron_async_reported", False):
        return
    try:
        err._megatron_async_reported = True
    except AttributeError:  # an exception type without a __dict__
        pass
    rank = os.environ.get("RANK", "0")
    if any(text in str(err) for text in _PEER_LOSS):
        _write_line(f"megatron-async: rank {rank}: lost a peer rank ({type(err).__name__}); {_who_names_it()}")
        time.sleep(PEER_LOSS_GRACE_S)
    else:
        record_error(f"rank {rank}: {type(err).__name__}: {err}")


def _who_names_it() -> str:
    """Where the rank that failed first is named: torchrun's summary, or the launcher's log."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return "torchrun names the rank that failed first"
    if os.environ.get("SLURM_JOB_ID"):
        return "the rank that failed first is the earliest failure in the job's log (srun's first non-zero task)"
    return "the rank that failed first is the earliest failure in the job's log"


def record_error(message: str) -> None:
    """Write torchrun's per-worker error file (TORCHELASTIC_ERROR_FILE), which its
    summary quotes as this rank's failure with the second it happened; then let that
    second pass."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    now = time.time()
    data = {"message": {"message": message, "extraInfo": {"py_callstack": message, "timestamp": str(int(now))}}}
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f)
    except OSError:
        return
    time.sleep(int(now) + 1 - now + 0.05)


def install_excepthook() -> None:
    """For entries without our launcher: an uncaught refusal or stop of ours ends the
    process with our one line and its exit code instead of a traceback."""
    sys.excepthook = excepthook_over(sys.excepthook)


def excepthook_over(previous):
    """Our excepthook in front of `previous` (`previous` itself if it is ours already)."""
    if getattr(previous, "megatron_async", False):
        return previous

    def hook(kind, err, tb):
        ours = our_line(err)
        if ours is None:
            other_failure(err)
            previous(kind, err, tb)
            return
        report(ours[0])
        from megatron_async.megatron_lm.safety import exit_flush

        exit_flush.before_exit(ours[1])
        sys.stdout.flush()
        os._exit(ours[1])  # process groups may hold threads that would block a normal exit

    hook.megatron_async = True
    return hook

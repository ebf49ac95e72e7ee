"""A save that fills --save's file system: one line of ours, and the partial folder set aside.

A disk can fill after the check before training (save_space.py): later checkpoints,
other jobs. Megatron's savers then fail on every rank with their own tracebacks, and
torch_dist's name no cause (its writer reports "an error is caught while starting
worker 0", the errno lost). The tracker still names the last complete checkpoint, but
the partial `iter_N` folder stays, and a torch-format one looks whole by its file names.

Here a save that raises on a file system without room for one checkpoint of this run
(or whose error says ENOSPC) stops the rank with one line naming the folder, the free
space and the last complete checkpoint, and the partial folder is renamed
`iter_N.torn` (a rename needs no space; whichever rank fails first does it), which
neither Megatron nor a resume reads as a checkpoint.
"""

from __future__ import annotations

import errno
import functools
import os
import shutil

from megatron_async.megatron_lm.safety.save_space import SaveSpaceError, free_bytes, needed_bytes, size_text

TORN_SUFFIX = ".torn"


def _says_no_space(err: BaseException) -> bool:
    """ENOSPC anywhere in the exception, its causes, or torch_dist's per-rank failures."""
    seen, todo = set(), [err]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if getattr(current, "errno", None) == errno.ENOSPC or os.strerror(errno.ENOSPC) in str(current):
            return True
        todo += [current.__cause__, current.__context__]
        failures = getattr(current, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):
            todo += [f for f in failures.values() if isinstance(f, BaseException)]
    return False


def set_aside(directory: str) -> str:
    """Rename a partial checkpoint folder to `<folder>.torn` (an older one of that name goes)."""
    torn = directory + TORN_SUFFIX
    try:
        if os.path.isdir(directory) and os.path.isdir(torn):
            shutil.rmtree(torn, ignore_errors=True)
        os.rename(directory, torn)
    except FileNotFoundError:  # another rank did it, or the save failed before the folder existed
        pass
    except OSError:  # a torn folder another rank is moving there now
        pass
    return torn


def no_space_line(save: str, iteration: int, err: BaseException):
    """Our error for a save that failed for want of space, or None for another failure."""
    from megatron_async.megatron_lm.safety.checkpoint_guard import tracked_iteration

    free, need = free_bytes(save), needed_bytes(save)
    if not (_says_no_space(err) or (need and free < need)):
        return None
    directory = os.path.join(save, f"iter_{iteration:07d}")
    torn = set_aside(directory)
    last = tracked_iteration(save)
    resume = (f"the last complete checkpoint is iteration {last}, which --load {save} resumes from" if last
              else "no complete checkpoint is there")
    needs = f", one checkpoint needs about {size_text(need)}" if need else ""
    return SaveSpaceError(
        f"megatron-async: error: --save {save}: no space left on device while saving {directory} "
        f"(iteration {iteration}; {size_text(free)} free{needs}); "
        f"the partial checkpoint was moved to {torn}; {resume}; free space (the partial checkpoint's too) "
        "or choose another --save")


def named_when_the_disk_fills(save_checkpoint):
    """Megatron's save_checkpoint(iteration, ...), whose failure on a full disk is our one line."""

    @functools.wraps(save_checkpoint)
    def hooked(iteration, *args, **kwargs):
        from megatron.training import get_args

        from megatron_async.megatron_lm.checkpoint.side_files import CheckpointStateError

        try:
            return save_checkpoint(iteration, *args, **kwargs)
        except (CheckpointStateError, KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:  # torch_dist's CheckpointException is a BaseException
            save = get_args().save
            ours = no_space_line(save, iteration, err) if save else None
            if ours is None:
                raise
            raise ours from err

    return hooked

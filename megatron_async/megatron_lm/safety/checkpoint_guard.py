"""Never start afresh over good checkpoints, never find a bad --save after training.

Megatron starts from iteration 1 when `--load` has no readable tracker file
(latest_checkpointed_iteration.txt) or does not exist, warning once, and then
overwrites the checkpoints of `--save` with the fresh run's: a misspelt `--load`
or a deleted tracker silently throws a run away. Checked before any process group
exists, on every rank, from the file system alone:

- `--load` holds complete checkpoints but no readable tracker: refused, naming the
  newest complete iteration and `--ckpt-step`;
- `--save` holds complete, undamaged checkpoints newer than the iteration this run
  resumes from: refused, naming the newest and `--load`;
- `--save` cannot be written: refused now rather than at the first save;
- `--load` is a file, or one iteration's folder (iter_NNNNNNN): refused, naming the
  directory to give.

An empty or missing `--load` still starts, saying so in one line (`fresh_start_notice`):
the first job of a requeue chain whose `--save` and `--load` are the same directory.
A checkpoint that fails to load is reported with its directory and the previous
complete iteration (`load_failure`).
"""

from __future__ import annotations

import glob
import os
import re
import tempfile
from typing import Optional

TRACKER = "latest_checkpointed_iteration.txt"
_ITERATION_DIR = re.compile(r"iter_(\d{7})")


def is_complete(directory: str) -> bool:
    """A checkpoint directory whose save finished: torch_dist writes `.metadata` last,
    the torch format one model_optim_rng.pt per model-parallel rank."""
    return os.path.isfile(os.path.join(directory, ".metadata")) or bool(
        glob.glob(os.path.join(directory, "mp_rank_*", "model_optim_rng.pt")))


def complete_iterations(root: Optional[str]) -> list[int]:
    """The iterations of `root`'s complete checkpoints, oldest first."""
    if not root or not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _ITERATION_DIR.fullmatch(name)
        if match and is_complete(os.path.join(root, name)):
            found.append(int(match.group(1)))
    return sorted(found)


def tracked_iteration(root: str) -> Optional[int]:
    """The iteration `root`'s tracker names (0 for a release checkpoint), None if unreadable."""
    try:
        with open(os.path.join(root, TRACKER), encoding="utf-8") as f:
            text = f.read().strip()
    except OSError:
        return None
    if text == "release":
        return 0
    return int(text) if text.isdigit() else None


def resume_problem(load: Optional[str], save: Optional[str], ckpt_step: Optional[int]) -> Optional[str]:
    """Why starting with these flags would silently start afresh over checkpoints, or None."""
    start = 0
    if load and os.path.exists(load) and not os.path.isdir(load):
        parent = os.path.dirname(os.path.abspath(load))
        hint = f" (here: --load {parent})" if tracked_iteration(parent) is not None else ""
        return (f"--load {load} is a file, not a checkpoint directory, so Megatron would start from scratch: give "
                f"the directory --save wrote, which holds {TRACKER} and the iter_* folders{hint}")
    one = _ITERATION_DIR.fullmatch(os.path.basename(os.path.normpath(load))) if load else None
    if one and ckpt_step is None and tracked_iteration(load) is None:
        return (f"--load {load} is one iteration's checkpoint, not the directory --save wrote, so Megatron would "
                f"start from scratch: pass --load {os.path.dirname(os.path.normpath(load)) or '.'} --ckpt-step "
                f"{int(one.group(1))}")
    if load:
        held = complete_iterations(load)
        tracked = tracked_iteration(load)
        if ckpt_step is not None:
            start = ckpt_step
        elif tracked is not None:
            start = tracked
        elif held:
            return (f"--load {load} holds checkpoints (the newest complete one: iteration {held[-1]}) but no "
                    f"readable {TRACKER}, so Megatron would start from scratch; pass --ckpt-step {held[-1]} to "
                    f"resume from it, or restore the tracker file")
    # a damaged newer checkpoint is no loss: resuming earlier (--ckpt-step, the advice a failed
    # load gives) saves that iteration again over it
    newer = [i for i in complete_iterations(save) if i > start
             and not damaged_files(os.path.join(save, f"iter_{i:07d}"))]
    lagging_tracker = (load and save and ckpt_step is None and tracked is not None
                       and os.path.realpath(load) == os.path.realpath(save))
    if newer and lagging_tracker:
        # a job stopped between finishing a checkpoint and updating the tracker (a node
        # failure, SIGKILL): its requeue resumes from the tracked one, as Megatron does, and
        # trains the same iterations again (resumes are bit for bit) over the newer ones
        return None
    if newer:
        where = f"resumes from iteration {start} of --load {load}" if load and start else "starts from scratch"
        return (f"--save {save} holds checkpoints newer than this run, which {where} (the newest: iteration "
                f"{newer[-1]}); they would be overwritten. Pass --load {save} to resume from them, or choose "
                "another --save")
    return None


def fresh_start_notice(load: Optional[str], ckpt_step: Optional[int] = None,
                       pretrained: Optional[str] = None) -> Optional[str]:
    """Our line for a --load with nothing to resume, which Megatron starts from scratch
    with one warning among its log; None when it will load something."""
    if not load or pretrained or tracked_iteration(load) is not None:
        return None
    if not os.path.exists(load):
        return (f"megatron-async: --load {load} does not exist: this run starts from scratch (iteration 0), "
                "as Megatron does")
    if os.path.isdir(load) and ckpt_step is None and not complete_iterations(load):
        return (f"megatron-async: --load {load} holds no checkpoint ({TRACKER}): this run starts from scratch "
                "(iteration 0), as Megatron does")
    return None


def unwritable_save(save: Optional[str]) -> Optional[str]:
    """Why `save` cannot be written to, or None. Probed by creating and removing a
    temporary file in it, or in its nearest existing parent (permission bits alone
    say yes to root, also for /proc); no directory is created."""
    if not save:
        return None
    path = os.path.abspath(save)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        handle, probe = tempfile.mkstemp(dir=path, prefix=".megatron_async_write_probe_")
    except OSError as err:
        return (f"--save {save}: cannot write in {path} ({err.strerror or err}), so the first checkpoint save "
                "would fail")
    os.close(handle)
    os.unlink(probe)
    return None


def load_failure(root: str, iteration: int, err: BaseException) -> str:
    """A one-line account of a checkpoint that failed to load, with the previous complete one."""
    older = [i for i in complete_iterations(root) if i < iteration]
    previous = (f"the previous complete checkpoint is iteration {older[-1]} (--ckpt-step {older[-1]})" if older
                else "no older complete checkpoint is there")
    detail = str(err).strip().splitlines()[0] if str(err).strip() else _where(err)
    directory = os.path.join(root, f"iter_{iteration:07d}")
    damaged = damaged_files(directory)
    named = f"; damaged: {', '.join(damaged)}" if damaged else ""
    return (f"--load {root}: the checkpoint of iteration {iteration} ({directory}) cannot be loaded "
            f"({type(err).__name__}{': ' + detail if detail else ''}){named}; {previous}")


def damaged_files(directory: str) -> list[str]:
    """Files of a checkpoint that are shorter than what it recorded (torch_dist: the byte
    ranges in `.metadata`), missing (torch_dist's `.metadata`) or not whole zip archives
    (torch format's .pt files)."""
    damaged = []
    metadata = os.path.join(directory, ".metadata")
    if os.path.isfile(os.path.join(directory, "metadata.json")) and not os.path.isfile(metadata):
        damaged.append(metadata)  # torch_dist writes it last: the save did not finish, or it was lost
    try:
        from torch.distributed.checkpoint import FileSystemReader

        needed: dict[str, int] = {}
        for info in FileSystemReader(directory).read_metadata().storage_data.values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
        for name, size in sorted(needed.items()):
            path = os.path.join(directory, name)
            if not os.path.isfile(path) or os.path.getsize(path) < size:
                damaged.append(path)
    except Exception:  # noqa: BLE001 - no torch_dist metadata to compare with
        pass
    import zipfile

    for path in sorted(glob.glob(os.path.join(directory, "**", "*.pt"), recursive=True)):
        if not zipfile.is_zipfile(path):
            damaged.append(path)
    return damaged


def _where(err: BaseException) -> str:
    """For an exception without a message (a bare assert): the line that raised it."""
    import traceback

    frames = traceback.extract_tb(err.__traceback__)
    if not frames:
        return ""
    last = frames[-1]
    return f"{last.line} at {last.filename.split('site-packages/')[-1]}:{last.lineno}"

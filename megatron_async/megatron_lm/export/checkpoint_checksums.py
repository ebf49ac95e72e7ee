"""The export checks a checkpoint's files against the checksums taken at save, as a resume does.

torch.distributed.checkpoint reads byte ranges without checking them, so a changed file would
export as wrong weights without a word. The checks are training's own, on
the checkpoint `--load` and `--ckpt-step` name: the marker (megatron_async.json, which holds the
files' checksums) against the checksum it holds of its own content (checkpoint/marker_checksum.py,
as a resume's argument validation checks it), then every file against its checksum
(safety/checksum_guard.verify_before_load, as a resume's load does): the same files, the same
skips (no marker, no checksums recorded, `--no-checkpoint-checksums`) and the same lines. The
latter runs in one rank of a one-process group, which the weights' read later starts afresh (a
torch-format read forks its ranks from this process, which must hold no group).
"""

from __future__ import annotations

import contextlib
import os
from types import SimpleNamespace

from megatron_async.megatron_lm.export import ExportError

OPT_OUT = "--no-checkpoint-checksums"


@contextlib.contextmanager
def _one_rank_group():
    """A one-rank gloo group for the check's collectives, unless one is there; removed after."""
    import torch

    if torch.distributed.is_initialized():
        yield
        return
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


def verify(load: str, ckpt_step: int | None, checked: bool = True) -> None:
    """Refuse (ExportError) the checkpoint `--load` / `--ckpt-step` name if its marker or a file
    differs from its checksum; `checked=False` is `--no-checkpoint-checksums`."""
    from megatron_async.megatron_lm.checkpoint.side_files import CheckpointStateError
    from megatron_async.megatron_lm.safety.checksum_guard import verify_before_load

    args = SimpleNamespace(load=load, ckpt_step=ckpt_step, no_checkpoint_checksums=not checked)
    if checked:
        _marker_intact(args)
    try:
        with _one_rank_group():
            verify_before_load(args)
    except CheckpointStateError as exc:
        line = str(exc).removeprefix("megatron-async: error: ")
        raise ExportError(f"{line}; {OPT_OUT} exports it unverified") from None


def _marker_intact(args) -> None:
    """Refuse a marker whose content no longer matches the checksum it holds of itself: the file
    checksums it records could have been edited with the file they describe."""
    from megatron_async.megatron_lm.checkpoint.marker import MARKER, saved_contents
    from megatron_async.megatron_lm.checkpoint.marker_checksum import seal_matches

    held = saved_contents(args)
    if held and seal_matches(held) is False:
        path = os.path.join(held["loaded_from"], MARKER)
        raise ExportError(f"--load {args.load}: {path} does not match the checksum it holds of its own content (it "
                          "changed after the save), so the checksums it records of the checkpoint's files are not "
                          f"to be trusted: restore it from a copy of the checkpoint, or pass {OPT_OUT} to export "
                          "unverified")

"""A checkpoint whose files changed after its save is refused before Megatron reads them.

Called by the load hook (adapter/hooks.py) for the checkpoint `--load` resumes, against the
checksums its marker recorded at save (checkpoint/checksums.py): a file whose bytes or size
differ, or that is missing, is named with the previous complete checkpoint, in one line on
every rank (exit 2). A checkpoint whose marker records no checksums (saved with
--no-checkpoint-checksums, in --ckpt-format torch, or by a megatron-async without checksums)
loads, and rank 0 says so once. The files every rank reads in Megatron's argument validation
already (`.metadata`, the common state: rank 0's) are checked there first, by each rank alone
(`verify_shared_files`): torch.distributed.checkpoint logs a traceback for each failed read of
a damaged `.metadata`, and the refusal then comes before Megatron's argument dump.
"""

from __future__ import annotations

import torch

from megatron_async.megatron_lm.checkpoint.checksums import KEY, agreed_problems, problems, shared_files
from megatron_async.megatron_lm.checkpoint.marker import saved_contents
from megatron_async.megatron_lm.checkpoint.side_files import CheckpointStateError
from megatron_async.megatron_lm.safety.checkpoint_guard import complete_iterations, damaged_files, tracked_iteration
from megatron_async.megatron_lm.safety.failures import FlagError


def verify_shared_files(args, contents: dict) -> None:
    """In argument validation, on each rank alone (no process group yet): refuse (FlagError) a
    `--load` checkpoint whose files that every rank reads there differ from their checksums.
    `contents`: what its marker holds (marker.saved_contents)."""
    recorded = contents.get(KEY)
    if not recorded or getattr(args, "no_checkpoint_checksums", False):
        return
    directory = contents["loaded_from"]
    found = problems(directory, shared_files(recorded), rank=0, world_size=1)
    if found:
        raise FlagError(_refusal(args, directory, found))


def verify_before_load(args) -> None:
    """Refuse (CheckpointStateError) a `--load` checkpoint whose files differ from their checksums.
    Every rank calls it (it gathers over all ranks when there are checksums to check)."""
    contents = saved_contents(args)
    if not contents:  # nothing to resume, or no marker: no checkpoint of a delayed run
        return
    directory = contents["loaded_from"]
    if getattr(args, "no_checkpoint_checksums", False):
        _say(f"megatron-async: --no-checkpoint-checksums: the files of {directory} are loaded unverified")
        return
    recorded = contents.get(KEY)
    if not recorded:
        why = (f"--ckpt-format {contents.get('ckpt_format')} takes none" if contents.get("ckpt_format") != "torch_dist"
               else "saved with --no-checkpoint-checksums or by a megatron-async without checksums")
        _say(f"megatron-async: {directory} holds no checksums of its files ({why}): they are loaded unverified")
        return
    found, seconds, checked = agreed_problems(directory, recorded)
    if found:
        raise CheckpointStateError(f"megatron-async: error: {_refusal(args, directory, found)}")
    _say(f"megatron-async: {len(recorded['files'])} files of {directory} ({checked / 2**20:.1f} MiB) match their "
         f"checksums ({seconds:.2f} s on the slowest rank)")


def _refusal(args, directory: str, found: list[str]) -> str:
    """The files that changed, and the previous complete checkpoint, in one line."""
    root = args.load
    step = getattr(args, "ckpt_step", None)
    iteration = step if step is not None else tracked_iteration(root)
    older = [i for i in complete_iterations(root) if iteration is None or i < iteration]
    previous = (f"the previous complete checkpoint is iteration {older[-1]} (--ckpt-step {older[-1]})" if older
                else "no older complete checkpoint is there")
    if older and not damaged_files(directory):  # the --save guard, which compares sizes, counts it as whole
        previous += f", and a resume from it that saves into {root} needs {directory} moved out of it first"
    return (f"--load {root}: the checkpoint of iteration {iteration} ({directory}) cannot be loaded: its files "
            f"changed after the save; damaged: {'; '.join(found)}; {previous}")


def _say(line: str) -> None:
    if torch.distributed.get_rank() == 0:
        print(line, flush=True)

"""The weight stash, EF state and RNG of a 2bw run in Megatron's own checkpoints.

- The stash and the EF state travel inside the optimizer's sharded state dict as
  per-rank objects (DelayedStepOptimizer / ErrorFeedbackOptimizer), so Megatron's
  save and load carry them in its own format, with the rest of the optimizer.
- After Megatron saves, rank 0 writes `megatron_async.json` into the checkpoint
  directory naming what it holds. On load a state the checkpoint lacks (a 1F1B
  checkpoint has no stash) is not asked for: the older weight version then starts
  equal to the newest, and EF starts without a previous update.
- When Megatron saves after step t, this stage may already have run warm-up
  forwards of batch t+1, drawing dropout masks. The saved RNG state is the one
  from before that batch's first forward, so a resumed run, which repeats those
  forwards, draws the same masks as the uninterrupted one.
"""

from __future__ import annotations

import json
import os
import random

import numpy as np
import torch

MARKER = "megatron_async.json"
_RNG_SNAPSHOTS: dict[int, tuple] = {}


def capture_rng() -> tuple:
    from megatron.core import tensor_parallel

    return (random.getstate(), np.random.get_state(), torch.get_rng_state(), torch.cuda.get_rng_state(),
            tensor_parallel.get_cuda_rng_tracker().get_states())


def restore_rng(state: tuple) -> None:
    from megatron.core import tensor_parallel

    python, numpy_state, cpu, cuda, tracker = state
    random.setstate(python)
    np.random.set_state(numpy_state)
    torch.set_rng_state(cpu)
    torch.cuda.set_rng_state(cuda)
    tensor_parallel.get_cuda_rng_tracker().set_states(tracker)


def snapshot_rng(batch: int) -> None:
    """Before batch `batch`'s first forward on this stage (kept for the last two batches)."""
    _RNG_SNAPSHOTS[batch] = capture_rng()
    for old in [b for b in _RNG_SNAPSHOTS if b < batch - 1]:
        del _RNG_SNAPSHOTS[old]


def rng_for_save(next_batch: int):
    """The RNG state a checkpoint taken before `next_batch` must hold (None: the current one)."""
    return _RNG_SNAPSHOTS.get(next_batch)


def checkpoint_dir(root: str, iteration: int) -> str:
    from megatron.training.checkpointing import get_checkpoint_name

    return get_checkpoint_name(root, iteration, return_base_dir=True)


def write_marker(root: str, iteration: int, contents: dict, create: bool = False) -> None:
    """Rank 0 writes what the checkpoint holds of ours (atomically)."""
    if torch.distributed.get_rank() != 0:
        return
    path = os.path.join(checkpoint_dir(root, iteration), MARKER)
    if create:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    if os.path.isdir(os.path.dirname(path)):
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(contents, f)
        os.replace(path + ".tmp", path)


def resume_directory(args) -> str | None:
    """The checkpoint directory `--load` will resume (None: nothing to resume).

    Reads the tracker file directly (Megatron's reader all-reduces), honouring --ckpt-step.
    """
    from megatron.training.checkpointing import get_checkpoint_tracker_filename

    root = args.load
    if not root:
        return None
    iteration = getattr(args, "ckpt_step", None)
    if iteration is None:
        try:
            with open(get_checkpoint_tracker_filename(root), encoding="utf-8") as f:
                text = f.read().strip()
        except OSError:
            return None
        if not text.isdigit():
            return None
        iteration = int(text)
    return checkpoint_dir(root, iteration)


def saved_megatron_args(directory: str):
    """The arguments Megatron saved with a checkpoint (None where it holds none): torch_dist's
    common state, else one rank's torch file, memory-mapped (no weights read)."""
    if not os.path.isdir(directory):
        return None
    try:
        if os.path.isfile(os.path.join(directory, "metadata.json")):  # torch_dist
            from megatron.core.dist_checkpointing.serialization import load_common_state_dict

            state = load_common_state_dict(directory)
        else:
            files = sorted(os.path.join(directory, d, "model_optim_rng.pt") for d in os.listdir(directory)
                           if d.startswith("mp_rank_"))
            if not files or not os.path.isfile(files[0]):
                return None
            state = torch.load(files[0], map_location="cpu", weights_only=False, mmap=True)
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException:  # noqa: BLE001 - torch's CheckpointException is a BaseException; a damaged
        return None  # checkpoint is the load guard's to name, on each rank where the load meets it
    return state.get("args") if isinstance(state, dict) else None


def holds_a_stash(directory: str) -> bool:
    """Whether a checkpoint directory holds a 2bw weight stash, read from its files alone:
    torch_dist lists it in `.metadata`, the torch format keeps per-rank files beside."""
    from megatron_async.megatron_lm.checkpoint import side_files

    if os.path.isdir(os.path.join(directory, side_files.SUBDIR)):
        return True
    try:
        from torch.distributed.checkpoint import FileSystemReader

        keys = FileSystemReader(directory).read_metadata().state_dict_metadata
    except Exception:  # noqa: BLE001 - no torch_dist metadata: nothing of ours in it
        return False
    return any(key.startswith("weight_stash") for key in keys)  # runtime.STASH_KEY, the optimizer's entry


def saved_contents(args) -> dict:
    """What the checkpoint `--load` will resume holds of ours ({} for none or a foreign one)."""
    directory = resume_directory(args)
    if directory is None:
        return {}
    try:
        with open(os.path.join(directory, MARKER), encoding="utf-8") as f:
            return {**json.load(f), "loaded_from": directory}
    except (OSError, ValueError):
        return {}

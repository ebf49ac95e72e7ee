"""`megatron_async.json`: what a checkpoint holds of ours, written next to it and read on resume.

After Megatron saves, rank 0 writes the marker into the checkpoint directory naming
what it holds (`contents_to_save`): the weight stash, the delay-correction state, the
stale global norm, where the per-rank state lives (the optimizer's sharded state dict
under torch_dist, per-rank files otherwise) and the layout it was saved at, sealed
with the checksum of its own content (marker_checksum.py). On load a state the
checkpoint lacks (a 1F1B checkpoint has no stash) is not asked for: the older weight
version then starts equal to the newest, and EF starts without a previous update.
Also here: the checkpoint `--load` resumes, and what Megatron saved with it (its
arguments, whether it holds a stash), read from its files alone.
"""

from __future__ import annotations

import json
import os

import torch

from megatron_async.megatron_lm.checkpoint.marker_checksum import sealed
from megatron_async.megatron_lm.checkpoint.optimizer_state import STALE_NORM_KEY, STASH_KEY

MARKER = "megatron_async.json"


def checkpoint_dir(root: str, iteration: int) -> str:
    from megatron.training.checkpointing import get_checkpoint_name

    return get_checkpoint_name(root, iteration, return_base_dir=True)


def write_marker(root: str, iteration: int, contents: dict, create: bool = False) -> None:
    """Rank 0 writes what the checkpoint holds of ours (atomically), sealed with the
    checksum of its own content (checkpoint/marker_checksum.py)."""
    if torch.distributed.get_rank() != 0:
        return
    path = os.path.join(checkpoint_dir(root, iteration), MARKER)
    if create:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    if os.path.isdir(os.path.dirname(path)):
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(sealed(contents), f)
        os.replace(path + ".tmp", path)


def contents_to_save(run) -> dict:
    """What a checkpoint of this delayed run (adapter/runtime.DelayedRun) holds of ours:
    nothing without a stash or with --no-save-optim; otherwise where the per-rank state
    lives (inside the optimizer's sharded state dict for torch_dist, in per-rank files
    otherwise) and the layout it was saved at."""
    from megatron.training import get_args

    from megatron_async.corrections.delay_correction import RULES
    from megatron_async.megatron_lm.adapter import run_mode
    from megatron_async.megatron_lm.checkpoint.side_files import layout

    args = get_args()
    mode = run_mode.of(args)
    if args.no_save_optim:
        return {}
    return {STASH_KEY: True, "delay_correction": args.delay_correction in RULES,
            "delay_correction_rule": args.delay_correction,
            STALE_NORM_KEY: STALE_NORM_KEY in run.step_states(),
            "pipeline_schedule": mode.name, "simulated_delay": mode.simulated_delay,
            "ckpt_format": args.ckpt_format, "per_rank_state": per_rank_state_home(args.ckpt_format),
            # the last stage's copy of the word embeddings, kept by the tied-embedding link (2bw only)
            "embedding_copy_linked": run.links_embedding_copy(),
            "stash_layout": "sharded" if args.ckpt_format == "torch_dist" else "per rank", "layout": layout()}


def per_rank_state_home(ckpt_format: str) -> str:
    """Where a checkpoint of this format keeps our per-rank state."""
    return "optimizer" if ckpt_format == "torch_dist" else "files"


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
    return any(key.startswith(STASH_KEY) for key in keys)  # the optimizer's entry


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

"""Our per-rank state in files next to a checkpoint, for formats without per-rank objects.

Under `--ckpt-format torch` Megatron saves one optimizer state dict per model-parallel
rank, written by data-parallel rank 0 only, and never asks for a sharded state dict:
the weight stash and the delay-correction state would not be saved at all, and EF
with the distributed optimizer differs from one data-parallel rank to the next. So
every rank writes its own file, `<checkpoint>/megatron_async/<rank>.pt`, before
Megatron's save writes its tracker (a checkpoint the tracker names has them), and
reads its own file back on load. The file name holds the rank's position and the
layout, so a file can only be read by the rank that wrote it.
"""

from __future__ import annotations

import os

# torch is imported by the functions that write and read the files: the --save lock
# (safety/save_lock.py) imports this module's error class in processes that load no torch.
SUBDIR = "megatron_async"


class CheckpointStateError(RuntimeError):
    """A checkpoint lacks, or cannot give back, the 2bw state its marker promises."""


def layout() -> dict:
    """This rank's parallel sizes, as the marker records them."""
    from megatron.core import parallel_state as ps

    return {"pp": ps.get_pipeline_model_parallel_world_size(), "tp": ps.get_tensor_model_parallel_world_size(),
            "ep": ps.get_expert_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size(with_context_parallel=True)}


def rank_file(checkpoint_dir: str) -> str:
    from megatron.core import parallel_state as ps

    sizes = layout()
    ranks = {"pp": ps.get_pipeline_model_parallel_rank(), "tp": ps.get_tensor_model_parallel_rank(),
             "ep": ps.get_expert_model_parallel_rank(), "dp": ps.get_data_parallel_rank(with_context_parallel=True)}
    name = "_".join(f"{k}{ranks[k]}of{sizes[k]}" for k in ("pp", "tp", "ep", "dp"))
    return os.path.join(checkpoint_dir, SUBDIR, f"{name}.pt")


def save(checkpoint_dir: str, state: dict) -> None:
    """Write this rank's state (atomically: a crash leaves no half-written file)."""
    path = rank_file(checkpoint_dir)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    import torch

    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)


def load(checkpoint_dir: str) -> dict:
    import torch

    path = rank_file(checkpoint_dir)
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise CheckpointStateError(
            f"megatron-async: {path} is missing: the checkpoint's megatron_async.json says it holds 2bw state "
            "per rank, but this rank's file is not there (an interrupted save, or files removed)") from None
    except Exception as err:  # noqa: BLE001 - a truncated or corrupt file: name it
        raise CheckpointStateError(f"megatron-async: {path} cannot be read ({type(err).__name__}: {err})") from None

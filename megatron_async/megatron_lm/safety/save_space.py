"""Room for a checkpoint in --save, checked before training.

A full disk would otherwise show only at the first save, after the training it was meant
to keep. Before training, every rank compares the free space of --save's file system
with the size of one checkpoint of this run, and refuses, naming both numbers, when it
does not fit. The size is an upper bound, from what real checkpoints hold
(tests/test_save_space.py measures them):

- per parameter of one replica: `bytes_per_parameter` (data-parallel copies are saved once,
  but state a rank keeps of its own as often as the ranks save it), plus Adam's second
  moment for the parameters Muon leaves to Adam (embeddings, output layer, norms, biases);
- per saved tensor, ITEM_BYTES: torch_dist writes each with torch.save (about 1.6 KiB of
  framing) and lists it in `.metadata`; a parameter is saved as its weights, main weights,
  each moment, each stash copy and each correction buffer;
- per rank, RANK_BYTES: its RNG state, Megatron's common state, the files' own framing;
  and CHECKPOINT_BYTES for the marker, Megatron's metadata and the tracker.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

from megatron_async.megatron_lm.checkpoint.side_files import CheckpointStateError

CORRECTION_COPIES = {"ef": 1, "dc-asgd": 2, "nesterov": 1}  # fp32 copies of the main weights a correction saves
MOMENT_TENSORS = {"adam": 2, "sgd": 1, "lion": 1, "muon": 1}  # fp32 state tensors a parameter has; others: 2
PLAIN_OPTIMIZERS = ("adam", "sgd", "lion")  # the others are Megatron's emerging optimizers (Muon, ...), which
SCALAR_OPTIMIZER = "adam"  # leave embeddings, the output layer and parameters not 2-D to this one
ITEM_BYTES = 2 << 10
RANK_BYTES = 64 << 10
CHECKPOINT_BYTES = 16 << 10


_NEEDED: dict[str, int] = {}  # --save (real path): what check_room found one checkpoint needs


class SaveSpaceError(CheckpointStateError):
    """--save's file system has no room for one checkpoint of this run."""


def needed_bytes(save: str) -> int:
    """What one checkpoint in `save` needs, as check_room found before training (0 if it did not run)."""
    return _NEEDED.get(os.path.realpath(save), 0)


def moment_tensors(optimizer: str) -> int:
    return MOMENT_TENSORS.get(optimizer, 2)


def per_rank_copies(args) -> tuple[int, int]:
    """How many times the data-parallel ranks save (the stash, a correction's buffers):
    the torch format's stash is in each rank's own file; a correction's buffers are the
    rank's whole copy, or its shard under the distributed optimizer."""
    dp = getattr(args, "data_parallel_size", 1) or 1
    stash = dp if args.ckpt_format == "torch" else 1
    return stash, 1 if args.use_distributed_optimizer else dp


def saved_tensors(args) -> int:
    """Tensors a checkpoint saves per parameter tensor of one replica."""
    import torch

    weight = torch.tensor([], dtype=args.params_dtype).element_size()
    main = 1 if weight != 4 or args.use_distributed_optimizer else 0
    stash, correction = per_rank_copies(args)
    return (1 + main + moment_tensors(args.optimizer) + stash * stash_copies(args)
            + correction * CORRECTION_COPIES.get(args.delay_correction, 0))


def bytes_per_parameter(args) -> int:
    """What a checkpoint stores per parameter: the weights in their dtype, fp32 main
    weights when the weights are not fp32 or the distributed optimizer keeps its own
    copy, the optimizer's fp32 moments, the 2bw stash (one more copy of the weights; two
    with weight prediction) and the delay correction's fp32 buffers, as often as
    `per_rank_copies` says."""
    import torch

    weight = torch.tensor([], dtype=args.params_dtype).element_size()
    main = 4 if weight != 4 or args.use_distributed_optimizer else 0
    stash, correction = per_rank_copies(args)
    return (weight + main + 4 * moment_tensors(args.optimizer) + stash * weight * stash_copies(args)
            + correction * 4 * CORRECTION_COPIES.get(args.delay_correction, 0))


def stash_copies(args) -> int:
    """Copies of the weights the stash holds beside the live ones (run_mode.RunMode.stash_copies):
    one under 2bw, K under --simulated-delay K, two with weight prediction; none for a
    synchronous run."""
    from megatron_async.megatron_lm.adapter import run_mode

    return run_mode.of(args).stash_copies


@dataclass
class Replica:
    """One model replica, summed over every rank."""

    params: int  # parameters
    scalar_params: int  # of which an emerging optimizer (Muon) leaves to SCALAR_OPTIMIZER
    tensors: int  # parameter tensors
    scalar_tensors: int  # of which an emerging optimizer leaves to SCALAR_OPTIMIZER
    entries: int  # other saved entries: buffers, modules' extra state


def replica_counts(model_chunks, args) -> Replica:
    """Dense parameters counted on data-parallel rank 0, experts on expert-data-parallel
    rank 0 (a collective over all ranks, at start-up)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.optimizer.emerging_optimizers import _is_nonlinear_or_embedding

    emerging = args.optimizer not in PLAIN_OPTIMIZERS
    dense_rank = parallel_state.get_data_parallel_rank(with_context_parallel=True)
    expert_rank = parallel_state.get_expert_data_parallel_rank()
    counts = [0, 0, 0, 0, 0]
    for chunk in model_chunks:
        for param in chunk.parameters():
            if (expert_rank if not getattr(param, "allreduce", True) else dense_rank) == 0:
                scalar = emerging and _is_nonlinear_or_embedding(param)
                counts[0] += param.numel()
                counts[1] += param.numel() if scalar else 0
                counts[2] += 1
                counts[3] += 1 if scalar else 0
        if dense_rank == 0:
            counts[4] += len(chunk.state_dict(keep_vars=True)) - len(dict(chunk.named_parameters()))
    total = torch.tensor(counts, dtype=torch.int64, device=torch.cuda.current_device())
    dist.all_reduce(total)
    return Replica(*(int(x) for x in total.tolist()))


def checkpoint_bytes(replica: Replica, args, world_size: int) -> int:
    """The most one checkpoint of this run takes on disk (see the module's docstring)."""
    scalar = max(moment_tensors(SCALAR_OPTIMIZER) - moment_tensors(args.optimizer), 0)  # more moments there
    return (replica.params * bytes_per_parameter(args) + replica.scalar_params * 4 * scalar
            + (replica.tensors * saved_tensors(args) + replica.scalar_tensors * scalar + replica.entries) * ITEM_BYTES
            + world_size * RANK_BYTES + CHECKPOINT_BYTES)


def free_bytes(save: str) -> int:
    path = os.path.abspath(save)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def check_room(save: str, model_chunks, args) -> None:
    """On every rank: refuse before training when one checkpoint does not fit in --save."""
    import torch.distributed as dist

    replica = replica_counts(model_chunks, args)
    need = checkpoint_bytes(replica, args, dist.get_world_size())
    _NEEDED[os.path.realpath(save)] = need
    free = free_bytes(save)
    if dist.get_rank() == 0:
        print(f"megatron-async: --save {save}: one checkpoint needs about {size_text(need)} ({need} bytes, "
              f"{need / replica.params:.1f} a parameter, metadata included); {size_text(free)} free", flush=True)
    if free < need:
        raise SaveSpaceError(
            f"megatron-async: --save {save} has {size_text(free)} free, but one checkpoint of this run needs "
            f"about {size_text(need)} (weights, optimizer state and the 2bw stash); free space or choose "
            "another --save")


def size_text(count: int) -> str:
    """Bytes in the unit that shows them: 512 B, 3.4 MiB, 12.50 GiB."""
    if count < 2**10:
        return f"{count} B"
    if count < 2**30:
        return f"{count / 2**20:.1f} MiB" if count >= 2**20 else f"{count / 2**10:.1f} KiB"
    return f"{count / 2**30:.2f} GiB"

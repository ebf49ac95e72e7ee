"""Room for a checkpoint in --save, checked before training.

A full disk used to show only at the first save, after the training it was meant to
keep, leaving a partial shard that a rerun trains past and fails on again. Before
training, every rank compares the free space of --save's file system with the size
of one checkpoint of this run: one replica of the parameters (data-parallel copies
are saved once), each at `bytes_per_parameter` (the plan's checkpoint term,
megatron_async/planning/plan.py), and refuses, naming both numbers, when it does not fit.
"""

from __future__ import annotations

import os
import shutil

from megatron_async.megatron_lm.checkpoint.side_files import CheckpointStateError

CORRECTION_COPIES = {"ef": 1, "dc-asgd": 2, "nesterov": 1}  # fp32 copies of the main weights a correction saves


class SaveSpaceError(CheckpointStateError):
    """--save's file system has no room for one checkpoint of this run."""


def bytes_per_parameter(args) -> int:
    """What a checkpoint stores per parameter: the weights in their dtype, fp32 main
    weights when the weights are not fp32, the optimizer's moments (Adam two, Muon's
    momentum and SGD's one, fp32), the 2bw stash (one more copy of the weights; two
    with weight prediction) and the delay correction's fp32 buffers."""
    import torch

    weight = torch.tensor([], dtype=args.params_dtype).element_size()
    main = 4 if weight != 4 else 0
    moments = 8 if args.optimizer == "adam" else 4
    return weight + main + moments + weight * stash_copies(args) + 4 * CORRECTION_COPIES.get(args.delay_correction, 0)


def stash_copies(args) -> int:
    """Copies of the weights the stash holds beside the live ones: one under 2bw, K under
    --simulated-delay K, two with weight prediction; none for a synchronous run."""
    from megatron_async.schedules.registry import delayed_runtime

    if not (delayed_runtime(args.pipeline_schedule) or args.simulated_delay > 0):
        return 0
    return 2 if args.delay_correction == "predict" else max(args.simulated_delay, 1)


def replica_parameters(model_chunks) -> int:
    """Parameters of one model replica, summed over every rank: dense ones counted on
    data-parallel rank 0, experts on expert-data-parallel rank 0 (a collective over all
    ranks, at start-up)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    dense_rank = parallel_state.get_data_parallel_rank(with_context_parallel=True)
    expert_rank = parallel_state.get_expert_data_parallel_rank()
    count = 0
    for chunk in model_chunks:
        for param in chunk.parameters():
            is_expert = not getattr(param, "allreduce", True)
            if (expert_rank if is_expert else dense_rank) == 0:
                count += param.numel()
    total = torch.tensor([count], dtype=torch.int64, device=torch.cuda.current_device())
    dist.all_reduce(total)
    return int(total.item())


def free_bytes(save: str) -> int:
    path = os.path.abspath(save)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def check_room(save: str, model_chunks, args) -> None:
    """On every rank: refuse before training when one checkpoint does not fit in --save."""
    import torch.distributed as dist

    need = replica_parameters(model_chunks) * bytes_per_parameter(args)
    free = free_bytes(save)
    if dist.get_rank() == 0:
        print(f"megatron-async: --save {save}: one checkpoint needs about {size_text(need)} "
              f"({bytes_per_parameter(args)} bytes a parameter); {size_text(free)} free", flush=True)
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

"""A torch-format checkpoint read at its own layout, one process per model-parallel rank, and
re-saved as torch_dist.

Each rank (forked from the exporting process, so Megatron is imported once) builds its model
chunks at the saved TP / PP / VPP / EP layout with Megatron's GPT builder, loads its own file as
Megatron's loader does (`torch.load` of the file Megatron's `get_checkpoint_name` names, one
per expert-parallel rank when EP > 1, each holding its own experts,
`model`/`modelN` into the chunks, strictly), and all ranks save the chunks' sharded state
dict with `dist_checkpointing.save`: the torch_dist checkpoint that checkpoint_reader.py
then reads as one stage. A refusal in a rank (an unreadable
file) reaches the exporting process as its message.
"""

from __future__ import annotations

import os


def convert(directory: str, out: str) -> None:
    """This rank's model chunks loaded from its own file, saved with every rank's as torch_dist in `out`."""
    import torch
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.training.checkpointing import get_checkpoint_name

    from megatron_async.megatron_lm.export import ExportError
    from megatron_async.megatron_lm.export import megatron_model as mm

    args = mm.layout_args(mm.saved_args(directory))
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    vpp, ep = args.virtual_pipeline_model_parallel_size, args.expert_model_parallel_size
    mm.start_process_group(tp, pp, vpp, ep)
    config = mm.model_config(args)
    chunks = [mm.build_model(config, vp_stage=v if vpp else None) for v in range(vpp or 1)]
    root, name = os.path.split(directory)
    path = get_checkpoint_name(root, 0 if name == "release" else int(name.split("_")[-1]), release=name == "release",
                               pipeline_parallel=pp > 1, tensor_rank=parallel_state.get_tensor_model_parallel_rank(),
                               pipeline_rank=parallel_state.get_pipeline_model_parallel_rank(), expert_parallel=ep > 1,
                               expert_rank=parallel_state.get_expert_model_parallel_rank())
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - a file torch cannot read is a torn checkpoint
        raise ExportError(f"--load: {directory} is torn: {os.path.relpath(path, directory)} is unreadable "
                          f"({type(exc).__name__}: {str(exc)[:120]})") from None
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    for key, chunk in zip(keys, chunks):
        chunk.load_state_dict(state[key], strict=True)
    os.makedirs(out, exist_ok=True)
    dist_checkpointing.save({key: chunk.sharded_state_dict() for key, chunk in zip(keys, chunks)}, out)
    torch.distributed.barrier()


def _rank(rank: int, world: int, directory: str, out: str, scratch: str) -> None:
    """One forked rank: its own gloo rank of `world` (a file store in `scratch`); a refusal's
    message goes to `scratch/error-RANK` for the parent."""
    import torch

    from megatron_async.megatron_lm.export import ExportError

    torch.distributed.init_process_group("gloo", init_method="file://" + os.path.join(scratch, "store"), rank=rank,
                                         world_size=world)
    try:
        convert(directory, out)
    except ExportError as exc:
        with open(os.path.join(scratch, f"error-{rank}"), "w", encoding="utf-8") as f:
            f.write(str(exc))
        raise


def to_torch_dist(directory: str, args, scratch: str) -> str:
    """The torch-format checkpoint `directory` re-saved as torch_dist under `scratch`, by one
    process per model-parallel rank forked from this one (Megatron is imported already)."""
    import glob

    import torch.multiprocessing

    from megatron_async.megatron_lm.export import ExportError

    out = os.path.join(scratch, "torch_dist")
    world = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.expert_model_parallel_size
    try:
        torch.multiprocessing.start_processes(_rank, args=(world, directory, out, scratch), nprocs=world,
                                              join=True, start_method="fork")
    except (torch.multiprocessing.ProcessRaisedException, torch.multiprocessing.ProcessExitedException) as exc:
        errors = sorted(glob.glob(os.path.join(scratch, "error-*")))
        if errors:
            raise ExportError(open(errors[0], encoding="utf-8").read()) from None
        raise RuntimeError(f"megatron-async: reading the torch-format checkpoint {directory} failed: {exc}") from None
    return out

"""Which checkpoint `--load` names, whether it is whole, and its weights as one pipeline stage at TP=1.

The weights are those of Megatron's own GPT built from the arguments saved with the
checkpoint, with every parallel size set to 1 (megatron_model.py), read one group (the
embedding, a layer, the output) at a time from torch_dist's chunks of whatever PP / TP / EP /
VPP layout the run saved at (checkpoint_stream.py). A torch-format checkpoint is first read at
its own layout by one forked process per model-parallel rank (torch_format_ranks.py:
`torch.load` through Megatron's checkpoint names, then the model's `load_state_dict`), which
save it as torch_dist for the same reading; those ranks hold their files whole meanwhile.

The weights taken are the model's own: the live version W(T), which Megatron evaluates,
never the 2bw stash's older version (`weight_stash.slot*` in the optimizer's state).
"""

from __future__ import annotations

import os

from megatron_async.megatron_lm.export import ExportError, megatron_model

TRACKER = "latest_checkpointed_iteration.txt"


def locate(load: str, ckpt_step: int | None) -> str:
    """The iteration directory `--load` (and `--ckpt-step`) name, or a refusal saying what is missing."""
    from megatron.training.checkpointing import get_checkpoint_name

    if not os.path.isdir(load):
        raise ExportError(f"--load {load}: no such directory")
    if ckpt_step is None:
        tracker = os.path.join(load, TRACKER)
        if not os.path.isfile(tracker):
            inside = " (this is one iteration's folder: give its parent)" if os.path.isfile(
                os.path.join(load, "metadata.json")) or any(d.startswith("mp_rank_") for d in os.listdir(load)) else ""
            raise ExportError(f"--load {load}: no {TRACKER}, so no complete checkpoint is named{inside}; "
                              "name one with --ckpt-step")
        text = open(tracker, encoding="utf-8").read().strip()
        if text == "release":
            return os.path.join(load, "release")
        if not text.isdigit():
            raise ExportError(f"--load {load}: {TRACKER} holds {text[:40]!r}, not an iteration")
        ckpt_step = int(text)
    directory = get_checkpoint_name(load, ckpt_step, return_base_dir=True)
    if not os.path.isdir(directory):
        raise ExportError(f"--load {load}: iteration {ckpt_step} has no folder {os.path.basename(directory)}")
    return directory


def _torch_dist_files(directory: str) -> None:
    """Every file torch_dist's own metadata names is there, at least as long as it says."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        storage = FileSystemReader(directory).read_metadata().storage_data
    except Exception as exc:  # noqa: BLE001 - any failure to read the index means a torn checkpoint
        raise ExportError(f"--load: {directory} is torn: its torch_dist index (.metadata) is unreadable "
                          f"({type(exc).__name__})") from None
    ends: dict[str, int] = {}
    for info in storage.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        path = os.path.join(directory, name)
        size = os.path.getsize(path) if os.path.isfile(path) else None
        if size is None or size < end:
            what = "is missing" if size is None else f"has {size} bytes of {end}"
            raise ExportError(f"--load: {directory} is torn: {name} {what}")


def _torch_files(directory: str, args) -> None:
    """Every model-parallel rank's file of the saved layout is there (one per expert rank too)."""
    from megatron.training.checkpointing import get_checkpoint_name

    root, name = os.path.split(directory)
    iteration = 0 if name == "release" else int(name.split("_")[-1])
    pp, tp, ep = args.pipeline_model_parallel_size, args.tensor_model_parallel_size, args.expert_model_parallel_size
    for p in range(pp):
        for t in range(tp):
            for e in range(ep):
                path = get_checkpoint_name(root, iteration, release=name == "release", pipeline_parallel=pp > 1,
                                           tensor_rank=t, pipeline_rank=p, expert_parallel=ep > 1, expert_rank=e)
                if not os.path.isfile(path):
                    raise ExportError(f"--load: {directory} is torn: {os.path.relpath(path, directory)} is missing "
                                      f"(saved at TP={tp} PP={pp}{f' EP={ep}' if ep > 1 else ''})")


def is_torch_dist(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, "metadata.json"))


def check_present(directory: str) -> None:
    """Refuse a torch_dist checkpoint with files missing or cut short (its own index says which;
    no saved argument is needed, so this comes before anything else is read from it)."""
    if is_torch_dist(directory):
        _torch_dist_files(directory)


def check_complete(directory: str, args) -> None:
    """Refuse a checkpoint of another format, or a torch-format one with a rank's file missing
    (a torch_dist one's files: check_present)."""
    if args.ckpt_format not in ("torch_dist", "torch"):
        raise ExportError(f"--ckpt-format {args.ckpt_format}: only torch_dist and torch checkpoints are read")
    if args.ckpt_format == "torch_dist" and not is_torch_dist(directory):
        raise ExportError(f"--load: {directory} is torn: its metadata.json is missing")
    if not is_torch_dist(directory):
        _torch_files(directory, args)
        megatron_model.layout_args(args)  # the ranks that read it can build its layers


def read_weights(directory: str, args, scratch: str):
    """The checkpoint's live weights, to be read one group at a time (checkpoint_stream.Weights);
    a torch-format checkpoint is first re-saved as torch_dist under `scratch`."""
    from megatron_async.megatron_lm.export import checkpoint_stream

    if not is_torch_dist(directory):
        from megatron_async.megatron_lm.export.torch_format_ranks import to_torch_dist

        directory = to_torch_dist(directory, args, scratch)
    return checkpoint_stream.open_weights(directory, args)

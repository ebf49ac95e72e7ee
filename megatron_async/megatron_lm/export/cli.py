"""`megatron-async-export-hf --load CKPT [--ckpt-step N] --out DIR`: a checkpoint as a Hugging Face model.

Every refusal (an `--out` that holds something or whose parent is missing or cannot be written,
no tracker, a torn checkpoint, a file or the marker that differs from its checksum, an architecture no
transformers class computes) comes before any weight is read and anything is written: one
`megatron-async: error:` line naming the flag, exit 2; `--out` is checked first, as it costs
nothing. A write the file system refuses later (a full disk) is one such line too, with nothing
left at `--out`. The weights are the live ones, never the 2bw stash (docs/two_bw.md,
"Evaluation and checkpoints"; docs/export_hf.md). They are read and written one group (the
embedding, a layer, the output) at a time, so the command holds about one layer in memory,
never the model: every tensor written is planned from the meta-device model first, checked
against the layout transformers saves, and the files are split at `--max-shard-size`.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from megatron_async.megatron_lm.export import ExportError
from megatron_async.megatron_lm.export.safetensors_shards import DEFAULT_MAX_SHARD_SIZE, INDEX, parse_size


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-async-export-hf", description=(
        "Write a Megatron checkpoint of a GPT run (2bw, --simulated-delay or synchronous; torch_dist or torch "
        "format; any PP/TP/EP layout) as a Hugging Face model folder: config.json, the weights as safetensors "
        "(model.safetensors, or shards with their index above --max-shard-size), generation_config.json and, for "
        "a SentencePiece run, the tokenizer. It reads and writes one layer at a time. The weights are the live ones "
        "(the model after the last step, which Megatron's evaluation runs), never the 2bw stash."))
    p.add_argument("--load", required=True, help="the run's --save folder (with latest_checkpointed_iteration.txt)")
    p.add_argument("--ckpt-step", type=int, default=None, help="export this iteration instead of the tracker's")
    p.add_argument("--out", required=True, help="the model folder to create (must not exist, or be empty)")
    p.add_argument("--tokenizer-model", default=None,
                   help="the run's SentencePiece model, where it is no longer at the path the run saved")
    p.add_argument("--no-checkpoint-checksums", action="store_true",
                   help="export without checking the checkpoint's files against the checksums taken at save "
                        "(as training's flag of that name skips the check at load)")
    p.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE,
                   help="the largest safetensors file (5GB, 500MB, 2GiB, bytes): a model larger than this is "
                        "written as model-0000i-of-0000n.safetensors files with model.safetensors.index.json, "
                        "as transformers splits a model (default %(default)s)")
    return p


def export(load: str, out: str, ckpt_step: int | None = None, tokenizer_model: str | None = None,
           checksums: bool = True, max_shard_size: str = DEFAULT_MAX_SHARD_SIZE) -> dict:
    """Export the live weights; returns what was written. `checksums`: check the checkpoint's
    files against those taken at save, as a resume does."""
    from megatron_async.megatron_lm.export import checkpoint_checksums, hf_architecture, hf_folder, hf_weights
    from megatron_async.megatron_lm.export import checkpoint_reader as reader
    from megatron_async.megatron_lm.export import megatron_model

    hf_folder.check_out(out)
    max_bytes = _max_bytes(max_shard_size)
    directory = reader.locate(load, ckpt_step)
    reader.check_present(directory)
    checkpoint_checksums.verify(load, ckpt_step, checksums)
    args = megatron_model.saved_args(directory)
    hf_architecture.refuse_unmapped(args)
    config = megatron_model.model_config(megatron_model.one_stage_args(args)).transformer
    arch = hf_architecture.architecture(args, config)
    tokenizer = hf_folder.tokenizer_model(args, tokenizer_model)
    reader.check_complete(directory, args)
    with tempfile.TemporaryDirectory(prefix="megatron-async-export-") as scratch:
        weights = reader.read_weights(directory, args, scratch)
        weights.check()
        embeddings = weights.meta("embedding")["embedding.word_embeddings.weight"]
        hf_config = hf_architecture.hf_config(arch, args, config, embeddings.shape[0], embeddings.dtype,
                                              hf_folder.special_ids(tokenizer))
        specs, groups = planned(arch, weights, config, hf_weights.saved_layout(hf_config))
        files = hf_folder.write_streamed(out, hf_config, specs, groups, tokenizer, max_bytes)
    return {"mtp_dropped": hf_weights.mtp_dropped(weights.mtp_keys), "directory": directory,
            "architecture": hf_architecture.CLASSES[arch], "out": os.path.abspath(out),
            "tokenizer": tokenizer is not None, "files": files}


def _max_bytes(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise ExportError(f"--max-shard-size {text}: {exc}") from None


def planned(arch: str, weights, config, layout: dict):
    """Every tensor the export writes, (name, shape, dtype) in order, found by mapping each
    group's meta tensors (nothing read) and checked against transformers' `layout`; and the
    groups' tensors, each group read and mapped when its turn comes (then zero biases)."""
    import torch

    from megatron_async.megatron_lm.export import hf_weights

    shapes = {}
    for name, _ in weights.groups:
        for key, tensor in hf_weights.hf_tensors(arch, weights.meta(name), config).items():
            shapes[key] = (tuple(tensor.shape), tensor.dtype)
    zeros = hf_weights.zero_biases(arch, shapes, layout)

    def groups():
        for name, _ in weights.groups:
            yield hf_weights.hf_tensors(arch, weights.read(name), config)
        if zeros:
            yield {key: torch.zeros(shape, dtype=dtype) for key, (shape, dtype) in zeros.items()}

    return [(key, shape, dtype) for key, (shape, dtype) in {**shapes, **zeros}.items()], groups()


def main(argv=None) -> None:
    from megatron_async.megatron_lm.export import out_of_memory

    options = parser().parse_args(argv)
    try:
        try:
            done = export(options.load, options.out, options.ckpt_step, options.tokenizer_model,
                          checksums=not options.no_checkpoint_checksums, max_shard_size=options.max_shard_size)
        except (MemoryError, RuntimeError) as exc:
            refused = out_of_memory.refusal(os.path.abspath(options.out), exc)
            if refused is None:
                raise
            raise refused from None
    except ExportError as exc:
        print(f"megatron-async: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    if done["mtp_dropped"]:
        print(f"megatron-async: left out the {done['mtp_dropped']} multi-token-prediction layer(s) "
              "(--mtp-num-layers): inference does not run them", flush=True)
    weights = done["files"][0] if len(done["files"]) == 1 else f"{len(done['files']) - 1} shards and {INDEX}"
    print(f"megatron-async: exported {done['directory']} (live weights) as {done['architecture']} to {done['out']}"
          f" ({weights}){' with its tokenizer' if done['tokenizer'] else ''}", flush=True)


if __name__ == "__main__":
    main()

"""`megatron-async-export-hf --load CKPT [--ckpt-step N] --out DIR`: a checkpoint as a Hugging Face model.

Every refusal (an `--out` that holds something or whose parent is missing or cannot be written,
no tracker, a torn checkpoint, a file or the marker that differs from its checksum, an architecture no
transformers class computes) comes before any weight is read and anything is written: one
`megatron-async: error:` line naming the flag, exit 2; `--out` is checked first, as it costs
nothing. A write the file system refuses later (a full disk) is one such line too, with nothing
left at `--out`. The weights are the live ones, never the 2bw stash (docs/two_bw.md,
"Evaluation and checkpoints"; docs/export_hf.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from megatron_async.megatron_lm.export import ExportError


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-async-export-hf", description=(
        "Write a Megatron checkpoint of a GPT run (2bw, --simulated-delay or synchronous; torch_dist or torch "
        "format; any PP/TP layout) as a Hugging Face model folder: config.json, model.safetensors, "
        "generation_config.json and, for a SentencePiece run, the tokenizer. The weights are the live ones "
        "(the model after the last step, which Megatron's evaluation runs), never the 2bw stash."))
    p.add_argument("--load", required=True, help="the run's --save folder (with latest_checkpointed_iteration.txt)")
    p.add_argument("--ckpt-step", type=int, default=None, help="export this iteration instead of the tracker's")
    p.add_argument("--out", required=True, help="the model folder to create (must not exist, or be empty)")
    p.add_argument("--tokenizer-model", default=None,
                   help="the run's SentencePiece model, where it is no longer at the path the run saved")
    p.add_argument("--no-checkpoint-checksums", action="store_true",
                   help="export without checking the checkpoint's files against the checksums taken at save "
                        "(as training's flag of that name skips the check at load)")
    return p


def export(load: str, out: str, ckpt_step: int | None = None, tokenizer_model: str | None = None,
           checksums: bool = True) -> dict:
    """Export the live weights; returns what was written. `checksums`: check the checkpoint's
    files against those taken at save, as a resume does."""
    from megatron_async.megatron_lm.export import checkpoint_checksums, hf_architecture, hf_folder, hf_weights
    from megatron_async.megatron_lm.export import checkpoint_reader as reader
    from megatron_async.megatron_lm.export import megatron_model

    hf_folder.check_out(out)
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
    embeddings = weights["embedding.word_embeddings.weight"]
    hf_config = hf_architecture.hf_config(arch, args, config, embeddings.shape[0], embeddings.dtype,
                                          hf_folder.special_ids(tokenizer))
    state = hf_weights.hf_state_dict(arch, weights, config, expected_shapes(hf_config))
    hf_folder.write(out, hf_config, state, tokenizer)
    return {"mtp_dropped": hf_weights.mtp_dropped(weights), "directory": directory, "architecture": hf_architecture.CLASSES[arch], "out": os.path.abspath(out),
            "tokenizer": tokenizer is not None}


def expected_shapes(hf_config) -> dict:
    """The transformers model's own state dict keys and shapes (built on the meta device)."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    return {key: tuple(value.shape) for key, value in model.state_dict().items()}


def main(argv=None) -> None:
    options = parser().parse_args(argv)
    try:
        done = export(options.load, options.out, options.ckpt_step, options.tokenizer_model,
                      checksums=not options.no_checkpoint_checksums)
    except ExportError as exc:
        print(f"megatron-async: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    if done["mtp_dropped"]:
        print(f"megatron-async: left out the {done['mtp_dropped']} multi-token-prediction layer(s) "
              "(--mtp-num-layers): inference does not run them", flush=True)
    print(f"megatron-async: exported {done['directory']} (live weights) as {done['architecture']} to {done['out']}"
          f"{' with its tokenizer' if done['tokenizer'] else ''}", flush=True)


if __name__ == "__main__":
    main()

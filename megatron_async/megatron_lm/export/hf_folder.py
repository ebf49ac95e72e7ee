"""The Hugging Face model folder: written into a staging folder beside `--out`, then renamed.

The weights go in one group at a time as the checkpoint is read (safetensors_shards.py: one
`model.safetensors`, or files of at most `--max-shard-size` and their index), then the
config, generation config and tokenizer. A reader of `--out` sees no folder or a complete one: an export stopped midway leaves only
a hidden `.NAME.export-*` folder beside it (removed when the export fails in Python). `--out`
must not exist or be empty; a folder with anything in it, a model above all, is refused, and so
is a parent folder that is missing or cannot be written, before the checkpoint is read. A write
the file system refuses later (a full disk) is one refusal naming `--out` (write_failures.py).
The tokenizer, where the run used SentencePiece, goes in as its .model file and as the
`tokenizers` file that transformers builds from it following its normaliser settings.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile

from megatron_async.megatron_lm.export import ExportError, safetensors_shards
from megatron_async.megatron_lm.export.write_failures import refused_as_out

MODEL_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
WRITING = "writing the model folder; nothing is left at --out"
DEFAULT_MAX_BYTES = safetensors_shards.parse_size(safetensors_shards.DEFAULT_MAX_SHARD_SIZE)
SENTENCEPIECE_TOKENIZERS = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")


def check_out(out: str) -> None:
    """Refuse an `--out` that exists and is not an empty folder, or whose parent folder (where the
    folder is staged and renamed) is missing or cannot be written."""
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        what = "is not a folder" if os.path.lexists(parent) else "does not exist"
        raise ExportError(f"--out {out}: its parent folder {what}")
    with refused_as_out(out, "checking that its parent folder can be written"):
        os.rmdir(tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out))}.export-", dir=parent))
    if not os.path.lexists(out):
        return
    if not os.path.isdir(out):
        raise ExportError(f"--out {out}: exists and is not a folder")
    held = sorted(os.listdir(out))
    model = [name for name in held if name in MODEL_FILES or SHARD.fullmatch(name)]
    if model:
        raise ExportError(f"--out {out}: already holds a model ({', '.join(model)}); choose another folder")
    if held:
        raise ExportError(f"--out {out}: is not empty ({', '.join(held[:3])}); choose another folder")


def tokenizer_model(args, override: str | None) -> str | None:
    """The SentencePiece model of the run (or `--tokenizer-model`), None for other tokenizers."""
    if override is None and args.tokenizer_type not in SENTENCEPIECE_TOKENIZERS:
        return None
    path = override or args.tokenizer_model
    if not path or not os.path.isfile(path):
        raise ExportError(f"--tokenizer-model {path}: the run's SentencePiece model is not there; "
                          "give its current path with --tokenizer-model")
    return path


def special_ids(model_path: str | None) -> dict:
    """bos/eos/pad ids of the SentencePiece model (eos is Megatron's end of document)."""
    if model_path is None:
        return {}
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=model_path)
    ids = {"bos_token_id": sp.bos_id(), "eos_token_id": sp.eos_id(), "pad_token_id": sp.pad_id()}
    return {key: value for key, value in ids.items() if value >= 0}


def _write_tokenizer(model_path: str, folder: str) -> None:
    import json

    import sentencepiece as spm
    import transformers

    sp = spm.SentencePieceProcessor(model_file=model_path)
    ids = {"unk_token": sp.unk_id(), "bos_token": sp.bos_id(), "eos_token": sp.eos_id(), "pad_token": sp.pad_id()}
    special = {name: sp.id_to_piece(i) for name, i in ids.items() if i >= 0}
    with tempfile.TemporaryDirectory(dir=folder) as source:  # on --out's file system, as every write
        shutil.copy(model_path, os.path.join(source, "tokenizer.model"))
        with open(os.path.join(source, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump({"tokenizer_class": "TokenizersBackend", **special}, f)
        tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    tokenizer.save_pretrained(folder)
    shutil.copy(model_path, os.path.join(folder, "tokenizer.model"))


def _usual_modes(folder: str) -> None:
    """The modes a plain mkdir and open give under this umask (the staging folder is private)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for name in os.listdir(folder):
        os.chmod(os.path.join(folder, name), 0o666 & ~umask)


def write(out: str, hf_config, state_dict: dict, tokenizer_path: str | None,
          max_shard_size: int = DEFAULT_MAX_BYTES) -> list[str]:
    """A model whose weights are all in memory (`state_dict`, transformers' saved names): see write_streamed."""
    specs = [(key, tuple(value.shape), value.dtype) for key, value in state_dict.items()]
    return write_streamed(out, hf_config, specs, [state_dict], tokenizer_path, max_shard_size)


def write_streamed(out: str, hf_config, specs: list[tuple], groups, tokenizer_path: str | None,
                   max_shard_size: int = DEFAULT_MAX_BYTES) -> list[str]:
    """Weights (safetensors, split at `max_shard_size`), config, generation config and tokenizer,
    staged and renamed to `out`. `specs`: every tensor's (name, shape, dtype) in the order
    `groups` (an iterable of dicts, each read only when its turn comes) yields them. A write the
    file system refuses is one refusal naming `--out`; on any failure nothing is left there.
    Returns the weight files written."""
    out = os.path.abspath(out)
    with refused_as_out(out, WRITING):
        staging = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.export-", dir=os.path.dirname(out))
    writer = safetensors_shards.Writer(staging, specs, max_shard_size)
    try:
        for group in groups:  # read outside the refusal: a failed read is no failure of --out
            with refused_as_out(out, WRITING):
                _write_group(writer, group)
            del group  # before the next group is read
        with refused_as_out(out, WRITING):
            files = writer.finish()
            _write_configs(staging, hf_config, tokenizer_path)
            _usual_modes(staging)
            with contextlib.suppress(FileNotFoundError, OSError):
                os.rmdir(out)  # an empty --out (check_out refused any other)
            os.rename(staging, out)
        return files
    except BaseException:
        writer.close()
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _write_group(writer, group: dict) -> None:
    """A group's tensors into the files (a function, so that no name outlives the group)."""
    for name, tensor in group.items():
        writer.add(name, tensor)


def _write_configs(folder: str, hf_config, tokenizer_path: str | None) -> None:
    import transformers

    hf_config.save_pretrained(folder)
    transformers.GenerationConfig.from_model_config(hf_config).save_pretrained(folder)
    if tokenizer_path is not None:
        _write_tokenizer(tokenizer_path, folder)

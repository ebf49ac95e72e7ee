"""A second built-in corpus: the Python standard library's own source code.

Conclusions drawn on one corpus (Shakespeare's plays) may be about that corpus; the
delay sweep is repeated on text of another kind. The standard library of the
interpreter that runs the preparation is on every machine that runs this project,
so the corpus needs no download: one document per module file (.py), tests, demos
and bundled packages and empty files left out, sorted by path. It depends on the Python version,
which stats.json records.
"""

from __future__ import annotations

import platform
import sysconfig
from pathlib import Path

from megatron_async.data.corpus import DataError, Document
from megatron_async.data.textfile import decode

LEFT_OUT = {"test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3", "idlelib", "turtledemo",
            "ensurepip"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def read_python_stdlib() -> tuple[list[Document], dict]:
    """(one document per standard-library module file, a description of the source)."""
    root = stdlib_root()
    files = sorted(p for p in root.rglob("*.py") if not LEFT_OUT.intersection(p.relative_to(root).parts))
    if not files:
        raise DataError(f"no standard-library sources under {root}")
    docs = [Document(str(p.relative_to(root)), decode(p.read_bytes(), str(p))) for p in files]
    docs = [d for d in docs if d.text.strip()]  # empty __init__.py files
    source = {"corpus": "python-stdlib", "python": platform.python_version(), "root": str(root),
              "files": len(docs), "document": "one per module file, without tests, demos, idlelib, lib2to3"}
    return docs, source

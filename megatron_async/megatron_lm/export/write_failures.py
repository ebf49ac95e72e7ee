"""A write under `--out` that the file system refuses, as one refusal naming `--out` and the cause.

The folder is written by Python (the safetensors files, config files, the staging folder, its
rename) and by the `tokenizers` library (a plain Exception with "os error N" in its text). Each of these failures is the same
thing to the user, a read-only file system, a full disk or a permission: one line, whatever
library met it. Any other exception is a defect of the exporter and propagates as it is.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re

from megatron_async.megatron_lm.export import ExportError

_OS_ERROR_IN_TEXT = re.compile(r"os error (\d+)")
_FULL = "free space there or choose another --out"
_CAUSES = {  # errno: (the cause, the fix)
    errno.EROFS: ("its file system is read-only", "choose an --out on a writable file system"),
    errno.ENOSPC: ("no space left on its device", _FULL),
    errno.EDQUOT: ("the disk quota is exceeded", _FULL),
    errno.EFBIG: ("a file is larger than its file system allows", "choose an --out on another file system"),
    errno.EACCES: ("permission denied", "choose an --out in a folder you can write"),
    errno.EPERM: ("operation not permitted", "choose an --out in a folder you can write"),
}


def os_error_number(exc: BaseException) -> int | None:
    """The OS error number behind a failed write, from Python's OSError or a library's message."""
    if isinstance(exc, OSError) and exc.errno:
        return exc.errno
    found = _OS_ERROR_IN_TEXT.search(str(exc))
    return int(found.group(1)) if found else None


def refusal(out: str, doing: str, exc: BaseException) -> ExportError | None:
    """The refusal for a failed write under `--out`, or None for an exception that is no write failure."""
    number = os_error_number(exc)
    if number is None and not isinstance(exc, OSError):
        return None
    if number in _CAUSES:
        cause, fix = _CAUSES[number]
    else:
        cause = os.strerror(number) if number is not None else f"{type(exc).__name__}: {str(exc)[:200]}"
        fix = "choose another --out"
    return ExportError(f"--out {out}: {cause}{_elsewhere(out, exc)} ({doing}); {fix}")


def _elsewhere(out: str, exc: BaseException) -> str:
    """The file named by the error where it is not one of `--out`'s own (a source, such as the
    tokenizer model); those are staged under hidden names that would tell the user nothing."""
    name = exc.filename if isinstance(exc, OSError) else None
    if not isinstance(name, (str, bytes, os.PathLike)):
        return ""
    name, parent = os.path.abspath(os.fsdecode(name)), os.path.dirname(os.path.abspath(out))
    return "" if os.path.commonpath([name, parent]) == parent else f" at {name}"


@contextlib.contextmanager
def refused_as_out(out: str, doing: str):
    """Turn a write failure inside the block into the one refusal naming `--out`."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - the libraries' own exception types; others re-raised
        refused = refusal(out, doing, exc)
        if refused is None:
            raise
        raise refused from None

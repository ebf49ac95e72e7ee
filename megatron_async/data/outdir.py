"""The `--out` folder of prepare-data: built aside, swapped in whole, never mixed with a previous run.

Writing in place would leave a stale split behind when a new run wrote fewer files, and a
run killed midway a new tokenizer next to old datasets. So every run writes into a
staging folder next to `--out` (same parent, so renames are atomic), and only a complete
folder is moved into place: readers see the old folder or the new one, never a mix. The
previous folder goes with everything in it, Megatron's index cache included (GPTDataset keys
that cache by path and settings, not by content, so a cache kept across new data would be
reused for it).

Staging and retired folders are named `.{out}.prepare-{pid}-*` and `.{out}.old-{pid}-*`; those
of dead processes are removed at the next run, those of live ones (a concurrent run) left alone.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Iterable, Iterator

from megatron_async.data.errors import DataError

# Directories Megatron may put its index cache in: GPTDataset's default `{prefix}/cache/`
# (a folder named like the dataset prefix) or a `--data-cache-path` inside the folder.
_CACHE_FILE = re.compile(r"(\.npy|-description\.txt)$")
_MAX_LISTED = 5


def resolve(out_dir) -> Path:
    """Absolute `--out`; a symlink is followed, so the swap replaces its target, not the link."""
    out = Path(out_dir).absolute()
    return out.resolve() if out.is_symlink() else out


def _is_cache_dir(path: Path) -> bool:
    """A folder holding nothing but Megatron index cache files (.npy, *-description.txt)."""
    if path.is_symlink() or not path.is_dir():
        return False
    for root, dirs, files in os.walk(path):
        if any(Path(root, d).is_symlink() for d in dirs):
            return False
        if not all(_CACHE_FILE.search(f) for f in files):
            return False
    return True


def check_replaceable(out: Path, file_names: Iterable[str], cache_dir_names: Iterable[str]) -> None:
    """Refuse an existing `out` that holds anything prepare-data did not write (it would be deleted)."""
    if not out.exists():
        return
    if not out.is_dir():
        raise DataError(f"--out {out}: exists and is not a folder")
    files, caches = set(file_names), set(cache_dir_names)
    foreign = sorted(
        p.name for p in out.iterdir()
        if not ((p.name in files and p.is_file() and not p.is_symlink()) or (p.name in caches and _is_cache_dir(p)))
    )
    if foreign:
        listed = ", ".join(foreign[:_MAX_LISTED]) + (f" and {len(foreign) - _MAX_LISTED} more" if
                                                       len(foreign) > _MAX_LISTED else "")
        raise DataError(f"--out {out}: the folder holds files that megatron-async-prepare-data did not write "
                        f"({listed}); it would replace the whole folder, so choose another --out")


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. PermissionError: someone else's live process
        return True
    return True


def _leftovers(out: Path, kind: str) -> list[Path]:
    """Staging ("prepare") or retired ("old") folders of `out` whose process is gone."""
    pattern = re.compile(rf"^\.{re.escape(out.name)}\.{kind}-(\d+)-")
    if not out.parent.is_dir():
        return []
    found = []
    for p in out.parent.iterdir():
        m = pattern.match(p.name)
        if m and p.is_dir() and not p.is_symlink() and not _pid_alive(int(m.group(1))):
            found.append(p)
    return sorted(found)


def clean_leftovers(out: Path, log=print) -> None:
    """Remove what killed runs left next to `out`.

    A run killed between retiring the old folder and moving the new one in (two renames)
    leaves no `out` at all: the retired folder is then moved back, so `out` is the previous
    complete folder again before anything is deleted.
    """
    retired = _leftovers(out, "old")
    if retired and not out.exists():
        os.rename(retired.pop(), out)
        log(f"restored {out} from an interrupted run")
    for p in retired + _leftovers(out, "prepare"):
        log(f"removing {p.name}, left by an interrupted run")
        shutil.rmtree(p, ignore_errors=True)


@contextlib.contextmanager
def staging(out: Path) -> Iterator[Path]:
    """A fresh folder next to `out` to write into; removed if the block raises."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.prepare-{os.getpid()}-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would otherwise become the final folder's mode
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def install(tmp: Path, out: Path) -> None:
    """Move the complete folder `tmp` to `out`, retiring and then deleting the previous `out`."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
        os.rename(out, old)
    try:
        os.rename(tmp, out)
    except OSError:
        if old is not None:
            os.rename(old, out)  # put the previous folder back rather than leave none
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)

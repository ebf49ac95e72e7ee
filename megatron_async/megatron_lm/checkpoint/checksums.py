"""Checksums of a torch_dist checkpoint's files: taken at save by the rank that wrote each file,
checked at load before Megatron reads any of them.

torch.distributed.checkpoint reads byte ranges and checks none of them, so bytes changed on a
disk, in a copy or by a file system load without a word: a silently wrong optimizer state.
Megatron's own `--verify-integrity` hashes every file with SHA-256 on rank 0 alone, at save and
at load (1-1.4 GB/s on one core, for the whole checkpoint); here each rank hashes what it
wrote with xxHash's XXH3 (8-15 GB/s on one core), in parallel (docs/benchmarks.md). At save, right after
Megatron's `dist_checkpointing.save` returned (this rank's `__<rank>_<n>.distcp` files are
whole; rank 0 also wrote the common state and metadata), every rank hashes its files and rank 0
gathers them into the checkpoint's marker, which it writes before the tracker names the
checkpoint. At load, the file rank r wrote is checked by rank r modulo the world size (the rank
that reads it when the layout is the same), and every rank learns what any of them found.
"""

from __future__ import annotations

import os
import re
import time

import torch
import xxhash

from megatron_async.megatron_lm.checkpoint.marker import MARKER

KEY = "checksums"  # in the marker (megatron_async.json)
ALGORITHM = "xxh3_64"
_CHUNK = 16 << 20
_WRITER = re.compile(r"__(\d+)_\d+\.distcp$")  # torch.distributed.checkpoint's per-rank file names


def digest(path: str) -> str:
    """The file's XXH3-64, read in chunks into one buffer."""
    hasher = xxhash.xxh3_64()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while size := f.readinto(buffer):
            hasher.update(view[:size])
    return hasher.hexdigest()


def written_by(directory: str, rank: int) -> list[str]:
    """The files of a torch_dist checkpoint directory that `rank` wrote (relative paths): its
    `.distcp` files; for rank 0 also every file that is no rank's `.distcp`, except the marker."""
    found = []
    for parent, _, names in os.walk(directory):
        for name in names:
            relative = os.path.relpath(os.path.join(parent, name), directory)
            writer = _WRITER.search(name)
            if writer is not None and int(writer.group(1)) == rank:
                found.append(relative)
            elif writer is None and rank == 0 and relative not in (MARKER, MARKER + ".tmp"):
                found.append(relative)
    return sorted(found)


def shared_files(recorded: dict) -> dict:
    """The recorded files that are no rank's `.distcp` (rank 0 wrote them: `.metadata`, the common
    state): every rank reads them, in Megatron's argument validation already."""
    return {**recorded, "files": {relative: entry for relative, entry in recorded.get("files", {}).items()
                                  if _WRITER.search(relative) is None}}


def this_ranks_checksums(directory: str) -> tuple[dict, float]:
    """{relative path: {"rank", "bytes", ALGORITHM}} of the files this rank wrote, and the seconds it took."""
    rank = torch.distributed.get_rank()
    start = time.perf_counter()
    files = {}
    for relative in written_by(directory, rank):
        path = os.path.join(directory, relative)
        files[relative] = {"rank": rank, "bytes": os.path.getsize(path), ALGORITHM: digest(path)}
    return files, time.perf_counter() - start


def gather(directory: str) -> dict | None:
    """Every rank: hash the files it wrote. Rank 0 gets what the marker records, the others None."""
    mine = this_ranks_checksums(directory)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    everyone = [None] * world if rank == 0 else None
    torch.distributed.gather_object(mine, everyone, dst=0)
    if rank != 0:
        return None
    files = {}
    for rank_files, _ in everyone:
        files.update(rank_files)
    return {"algorithm": ALGORITHM, "files": dict(sorted(files.items())),
            "seconds": round(max(seconds for _, seconds in everyone), 4)}


def problems(directory: str, recorded: dict, rank: int, world_size: int) -> list[str]:
    """The recorded files that this rank checks and that differ from what was recorded, each as
    "path (why)"; an algorithm this version does not know is a problem of rank 0."""
    if recorded.get("algorithm") != ALGORITHM:
        return [f"{directory} (its checksums are {recorded.get('algorithm')!r}, which this megatron-async "
                f"cannot check; it checks {ALGORITHM})"] if rank == 0 else []
    found = []
    for relative, entry in recorded.get("files", {}).items():
        if int(entry.get("rank", 0)) % world_size != rank:
            continue
        path = os.path.join(directory, relative)
        try:
            size = os.path.getsize(path)
            if size != entry["bytes"]:
                found.append(f"{path} ({size} bytes, {entry['bytes']} at save)")
            elif digest(path) != entry[ALGORITHM]:
                found.append(f"{path} (its {ALGORITHM} checksum differs from the one taken at save: "
                             "its bytes changed)")
        except FileNotFoundError:
            found.append(f"{path} (missing)")
        except OSError as err:
            found.append(f"{path} (unreadable: {err.strerror or err})")
    return found


def agreed_problems(directory: str, recorded: dict) -> tuple[list[str], float, int]:
    """Every rank checks its share of the recorded files; every rank gets all problems found,
    the slowest rank's seconds and the bytes checked."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    start = time.perf_counter()
    mine = problems(directory, recorded, rank, world)
    seconds = time.perf_counter() - start
    everyone = [None] * world
    torch.distributed.all_gather_object(everyone, (mine, seconds))
    checked = sum(entry.get("bytes", 0) for entry in recorded.get("files", {}).values())
    return [p for found, _ in everyone for p in found], max(s for _, s in everyone), checked

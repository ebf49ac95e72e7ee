"""The checksum `megatron_async.json` holds of its own content.

The marker says how a checkpoint resumes (whether it holds the weight stash, the
delay-correction state, the layout, the checksums of the checkpoint's files), so an
edit to it, `"weight_stash": false` say, would change the resume without a word while
every file it names still matches. Rank 0 seals what it writes with the XXH3-64 of its
canonical JSON (sorted keys, no spaces); the resume recomputes it before Megatron reads
anything (safety/resume_checks.py). A marker without the seal (written by a
megatron-async that did not seal it) has nothing to check.
"""

from __future__ import annotations

import json

import xxhash

KEY = "marker_checksum"
ALGORITHM = "xxh3_64"
_ADDED_ON_READ = ("loaded_from",)  # the directory marker.saved_contents adds to what it read


def _canonical(contents: dict) -> bytes:
    """The content as JSON gives it back (tuples as lists, keys as strings), sorted, without the seal."""
    plain = json.loads(json.dumps(contents))
    for key in (KEY, *_ADDED_ON_READ):
        plain.pop(key, None)
    return json.dumps(plain, sort_keys=True, separators=(",", ":")).encode("utf-8")


def sealed(contents: dict) -> dict:
    """`contents` with the checksum of its own content."""
    return {**contents, KEY: {ALGORITHM: xxhash.xxh3_64_hexdigest(_canonical(contents))}}


def seal_matches(contents: dict) -> bool | None:
    """Whether a marker's content (as read) matches the checksum it holds; None: it holds none."""
    seal = contents.get(KEY)
    if seal is None:
        return None
    return isinstance(seal, dict) and seal.get(ALGORITHM) == xxhash.xxh3_64_hexdigest(_canonical(contents))

"""Where GPTDataset may cache its sample indices without ever reusing them for other data.

GPTDataset names its cached document/sample/shuffle indices after the dataset path and the
settings only, not after the data. Data replaced at the same path (a repeated prepare-data
run) would therefore reuse indices built for the old data: wrong document boundaries, or
samples past the end. The indices depend on the data only through the .idx files (sequence
lengths and document boundaries), so a cache subfolder named after their SHA-256 is hit
exactly when the cached indices are valid.
"""

from __future__ import annotations

import hashlib
import os
from typing import Optional, Sequence


def keyed_cache_path(cache_root: Optional[str], prefixes: Sequence[str]) -> Optional[str]:
    """`cache_root`/data-<digest of the .idx files of `prefixes`>, or None when `cache_root` is None.

    None keeps GPTDataset's default, a `cache` folder under each dataset prefix: it lives in
    the prepared folder, which prepare-data replaces whole, so it cannot outlive its data.
    """
    if cache_root is None:
        return None
    digest = hashlib.sha256()
    for prefix in prefixes:
        digest.update(os.path.basename(prefix).encode() + b"\0")
        with open(f"{prefix}.idx", "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return os.path.join(cache_root, f"data-{digest.hexdigest()[:16]}")

"""How the GPU suite compares two runs' losses: one number, checked against a stated tolerance.

In bf16 on GPUs two layouts of the same algorithm agree to round-off, not
bitwise, so runs are compared by the largest relative difference over
iterations; a negative control computes the same number against a run of
another algorithm and must exceed the tolerance.
"""

from __future__ import annotations

import math
from typing import Sequence


def finite_losses(losses: Sequence, expected: int) -> list[float]:
    """The losses, checked: `expected` of them, every one finite."""
    assert len(losses) == expected, f"{len(losses)} losses, expected {expected}: {losses}"
    assert all(x is not None and math.isfinite(x) for x in losses), losses
    return list(losses)


def max_relative_difference(a: Sequence[float], b: Sequence[float]) -> float:
    """max over iterations of |a_i - b_i| / |b_i| (the runs must have equal length)."""
    assert len(a) == len(b), f"{len(a)} against {len(b)} iterations"
    return max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a, b))

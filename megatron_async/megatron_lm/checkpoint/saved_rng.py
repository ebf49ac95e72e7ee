"""The RNG state a 2bw checkpoint saves.

When Megatron saves after step t, this stage may already have run warm-up forwards of
batch t+1, drawing dropout masks. The saved RNG state is the one from before that
batch's first forward (`snapshot_rng`, which adapter/runtime.py gives the 2bw runner
as its batch-start callback; the hook on Megatron's `get_rng_state` saves
`rng_for_save`), so a resumed run, which repeats those forwards, draws the same masks
as the uninterrupted one.
"""

from __future__ import annotations

import random

import numpy as np
import torch

_RNG_SNAPSHOTS: dict[int, tuple] = {}


def capture_rng() -> tuple:
    from megatron.core import tensor_parallel

    return (random.getstate(), np.random.get_state(), torch.get_rng_state(), torch.cuda.get_rng_state(),
            tensor_parallel.get_cuda_rng_tracker().get_states())


def restore_rng(state: tuple) -> None:
    from megatron.core import tensor_parallel

    python, numpy_state, cpu, cuda, tracker = state
    random.setstate(python)
    np.random.set_state(numpy_state)
    torch.set_rng_state(cpu)
    torch.cuda.set_rng_state(cuda)
    tensor_parallel.get_cuda_rng_tracker().set_states(tracker)


def snapshot_rng(batch: int) -> None:
    """Before batch `batch`'s first forward on this stage (kept for the last two batches)."""
    _RNG_SNAPSHOTS[batch] = capture_rng()
    for old in [b for b in _RNG_SNAPSHOTS if b < batch - 1]:
        del _RNG_SNAPSHOTS[old]


def rng_for_save(next_batch: int):
    """The RNG state a checkpoint taken before `next_batch` must hold (None: the current one)."""
    return _RNG_SNAPSHOTS.get(next_batch)

"""The RNG state a 2bw checkpoint saves.

When Megatron saves after step t, this stage may already have run warm-up forwards of
batch t+1, drawing dropout masks. The saved RNG state is the one from before that
batch's first forward (`RngSnapshots.snapshot`, which adapter/two_bw_run.py gives the 2bw
runner as its batch-start callback; the hook on Megatron's `get_rng_state` saves
`RngSnapshots.for_save`), so a resumed run, which repeats those forwards, draws the
same masks as the uninterrupted one. The snapshots belong to the run (adapter/two_bw_run.TwoBWRun).
"""

from __future__ import annotations

import random

import numpy as np
import torch



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


class RngSnapshots:
    """One run's RNG states from before its last two batches' first forwards."""

    def __init__(self):
        self.by_batch: dict[int, tuple] = {}

    def snapshot(self, batch: int) -> None:
        """Before batch `batch`'s first forward on this stage (kept for the last two batches)."""
        self.by_batch[batch] = capture_rng()
        for old in [b for b in self.by_batch if b < batch - 1]:
            del self.by_batch[old]

    def for_save(self, next_batch: int):
        """The RNG state a checkpoint taken before `next_batch` must hold (None: the current one)."""
        return self.by_batch.get(next_batch)

"""Process-group setup: Megatron's model-parallel groups and seeded RNG on any device.

The planner (plan.py) builds each stage under these groups in one process; the tests'
tiny GPT (tests/support/tiny_gpt.py) sets up its ranks with the same function."""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed


def init_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    seed: int = 1234,
) -> None:
    """Create Megatron's parallel groups over the initialised default group and seed.

    Seeding follows Megatron: the same seed on every rank for data-parallel
    replicas, offset per TP/EP rank inside Megatron's RNG tracker.
    """
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
    )
    # Megatron-LM offsets the seed by pipeline rank so stages draw different
    # dropout masks; do the same.
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)

"""Per-rank state inside an optimizer's sharded state dict (weight stash, EF buffers).

Such state belongs to one (PP, TP, DP) rank and is saved as one dist-checkpoint
object per rank, so any checkpoint format that carries the optimizer carries it.
A wrapper optimizer adds its entry to the state dict Megatron asks for (unless
loading a checkpoint known not to hold it) and takes it out again on load.
"""

from __future__ import annotations

from typing import Callable

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject


def per_rank_object(key: str, state) -> ShardedObject:
    """One record per (PP, TP, DP) rank: each rank restores its own."""
    pp = (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_world_size())
    tp = (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size())
    dp = (parallel_state.get_data_parallel_rank(with_context_parallel=True),
          parallel_state.get_data_parallel_world_size(with_context_parallel=True))
    return ShardedObject(key, state, (pp[1], tp[1], dp[1]), (pp[0], tp[0], dp[0]), replica_id=0)


def add_state(sharded: dict, key: str, state: Callable[[], dict], is_loading: bool, expected: bool = True) -> dict:
    """`sharded` with this rank's `state()` under `key`; on load only if the checkpoint holds it."""
    if not is_loading or expected:
        sharded[key] = per_rank_object(key, state())
    return sharded


def pop_state(state_dict, key: str, load: Callable[[dict], None]):
    """Hand `state_dict[key]` (if present) to `load`; returns the rest for the wrapped optimizer."""
    if isinstance(state_dict, dict) and key in state_dict:
        state_dict = dict(state_dict)
        load(state_dict.pop(key))
    return state_dict

"""Our state inside Megatron's optimizer state: what the wrapper optimizers add to the
sharded state dict Megatron saves, and take out again on load.

- Per-rank objects: state that belongs to one (PP, TP, DP) rank (the delay-correction
  state, the stale global norm, a stash in checkpoints older than the sharded layout)
  is saved as one dist-checkpoint object per rank, so any checkpoint format that
  carries the optimizer carries it. A wrapper optimizer (DelayedStepOptimizer,
  corrections/delay_correction.py) adds its entry to the state dict Megatron asks for
  (unless loading a checkpoint known not to hold it) and takes it out again on load.
- The delayed optimizer (adapter/runtime.DelayedStepOptimizer): the weight stash laid
  out like the model's weights (stash/stash_checkpoint.py), so torch_dist reshards it
  with them, and the stale global norm; on load, under formats without per-rank
  objects, this rank's file (side_files.py).
- `per_rank_state` / `load_per_rank_state`: the same state of a delayed run
  (adapter/runtime.DelayedRun) as one dict, for a per-rank file.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

STASH_KEY = "weight_stash"
STALE_NORM_KEY = "stale_global_norm"


def per_rank_object(key: str, state) -> ShardedObject:
    """One record per (PP, TP, DP) rank: each rank restores its own."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject

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


def sharded_state_dict(optimizer, model_sharded_state_dict, is_loading: bool = False, **kwargs) -> dict:
    """A DelayedStepOptimizer's sharded state dict: the wrapped optimizer's, with the stale
    global norm and the weight stash."""
    run = optimizer.run
    state = optimizer.optimizer.sharded_state_dict(model_sharded_state_dict, is_loading, **kwargs)
    for key, held in run.step_states().items():
        add_state(state, key, held.state_dict, is_loading, optimizer.loads(key))
    if not is_loading or (optimizer.load_stash and run.resumed.get("stash_layout") == "sharded"):
        from megatron_async.stash import stash_checkpoint

        # laid out like the model's weights, so torch_dist reshards it with them
        state[STASH_KEY] = stash_checkpoint.sharded_state_dict(optimizer.stash, model_sharded_state_dict)
        return state
    # a per-rank object, as checkpoints before the sharded layout hold it
    return add_state(state, STASH_KEY, optimizer.stash.state_dict, is_loading, optimizer.load_stash)


def load_state_dict(optimizer, state_dict) -> None:
    """Load a DelayedStepOptimizer: our entries to the stash and the stale norm, the rest to
    the wrapped optimizer; then, for a checkpoint with per-rank files, this rank's file."""
    run = optimizer.run
    for key, held in run.step_states().items():
        state_dict = pop_state(state_dict, key, held.load_state_dict)
    optimizer.optimizer.load_state_dict(pop_state(state_dict, STASH_KEY, lambda state: load_stash(optimizer, state)))
    if run.resumed.get(STASH_KEY) and run.resumed.get("per_rank_state") == "files":
        from megatron_async.megatron_lm.checkpoint import side_files

        load_per_rank_state(run, side_files.load(run.resumed["loaded_from"]))


def load_stash(optimizer, state: dict) -> None:
    if not optimizer.load_stash:  # not asked for: torch_dist still returns its plain values (common state)
        return
    if "sharded_slots" in state:
        from megatron_async.stash import stash_checkpoint

        stash_checkpoint.load(optimizer.stash, state)
    else:  # a per-rank object, as checkpoints before the sharded layout hold it
        optimizer.stash.load_state_dict(state)


def per_rank_state(run) -> dict:
    """This rank's 2bw state for a per-rank file: stash, delay correction, stale global norm."""
    state = {STASH_KEY: run.stash.state_dict()}
    correction = getattr(run.optimizer, "delay_correction", None)
    if correction is not None:
        state["delay_correction"] = correction.state_dict()
    for key, held in run.step_states().items():
        state[key] = held.state_dict()
    return state


def load_per_rank_state(run, state: dict) -> None:
    run.stash.load_state_dict(state[STASH_KEY])
    correction = getattr(run.optimizer, "delay_correction", None)
    if correction is not None and "delay_correction" in state:
        correction.load_state_dict(state["delay_correction"])
    for key, held in run.step_states().items():
        if key in state:
            held.load_state_dict(state[key])

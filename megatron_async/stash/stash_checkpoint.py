"""The weight stash in a torch_dist checkpoint, laid out like the model's own weights.

Each stashed version of each parameter is saved as a ShardedTensor with the model
parameter's own key (prefixed), global shape, offsets and replica ids, built the
way Megatron builds its optimizer's state (`make_sharded_optimizer_tensor`). So
torch_dist reshards the stash exactly as it reshards the model: a checkpoint saved
at one PP / TP / DP / EP layout resumes at another with the older weight version
intact. The version numbers are the same on every rank and ride as plain values.
The delayed optimizer puts it into its sharded state dict
(megatron_async/megatron_lm/checkpoint/optimizer_state.py).
"""

from __future__ import annotations

import torch

from megatron_async.stash.weight_stash import WeightStashManager

PREFIX = "weight_stash"


def sharded_state_dict(stash: WeightStashManager, model_sharded_state_dict: dict) -> dict:
    """The stash as ShardedTensors (one per slot and parameter) plus its version numbers."""
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        make_sharded_optimizer_tensor,
    )

    by_index = get_param_id_to_sharded_param_map(model_sharded_state_dict, stash.params)
    missing = [stash.param_name(i) for i in range(len(stash.params)) if i not in by_index]
    if missing:
        raise RuntimeError(f"megatron-async: parameters without a sharded checkpoint entry: {missing[:5]}")
    slots = [[make_sharded_optimizer_tensor(by_index[i], views[i], f"{PREFIX}.slot{s}")
              for i in range(len(stash.params))] for s, views in enumerate(stash.slot_views())]
    return {"newest": stash.newest, "slot_version": list(stash.slot_versions()), "sharded_slots": slots}


@torch.no_grad()
def load(stash: WeightStashManager, state: dict) -> None:
    """Restore what `sharded_state_dict` saved (after torch_dist loaded its tensors)."""
    stash.load_versions(state["newest"], state["slot_version"], state["sharded_slots"])

"""`megatron-async-export-hf` with a chosen weight version, for the export tests' control.

    python -m tests.support.export_version live|stash LOAD OUT

`stash` exports the 2bw stash's older weights W(T-1) instead of the live W(T): what the
export must never do, and what the tests show to differ from Megatron's evaluation. The
stash is read here, by replacing the reader's load, so the package has no way to export it.
"""

import sys

import torch

from megatron_async.megatron_lm.export import ExportError, checkpoint_reader
from megatron_async.megatron_lm.export.cli import export


def _stash_slot(directory: str) -> int:
    """The stash slot holding the version before the live one."""
    from megatron.core.dist_checkpointing.serialization import load_common_state_dict

    stash = load_common_state_dict(directory).get("optimizer", {}).get("weight_stash")
    if not stash or "slot_version" not in stash:
        raise ExportError(f"--load: {directory} holds no sharded 2bw weight stash")
    return stash["slot_version"].index(stash["newest"] - 1)


@torch.no_grad()
def load_stash(model, directory: str) -> None:
    """The model's parameters from the stash slot of a torch_dist checkpoint."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        make_sharded_optimizer_tensor,
    )

    params = list(model.parameters())
    by_index = get_param_id_to_sharded_param_map(model.sharded_state_dict(), params)
    prefix = f"weight_stash.slot{_stash_slot(directory)}"
    request = {i: make_sharded_optimizer_tensor(by_index[i], p.detach(), prefix) for i, p in enumerate(params)}
    loaded = dist_checkpointing.load(request, directory)
    for i, p in enumerate(params):
        p.copy_(loaded[i])


if __name__ == "__main__":
    version, load, out = sys.argv[1:4]
    if version == "stash":
        checkpoint_reader._load = load_stash
    elif version != "live":
        sys.exit(f"version: live or stash, not {version}")
    export(load, out)

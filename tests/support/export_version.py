"""`megatron-async-export-hf` with a chosen weight version, for the export tests' control.

    python -m tests.support.export_version live|stash LOAD OUT

`stash` exports the 2bw stash's older weights W(T-1) instead of the live W(T): what the
export must never do, and what the tests show to differ from Megatron's evaluation. The
stash is read here, by pointing the reader's checkpoint keys at the stash slot's copies
(`weight_stash.slotN.<key>`, saved at the model weights' own offsets), so the package has no
way to export it.
"""

import sys

from megatron_async.megatron_lm.export import ExportError, checkpoint_reader, checkpoint_stream
from megatron_async.megatron_lm.export.cli import export


def _stash_slot(directory: str) -> int:
    """The stash slot holding the version before the live one."""
    from megatron.core.dist_checkpointing.serialization import load_common_state_dict

    stash = load_common_state_dict(directory).get("optimizer", {}).get("weight_stash")
    if not stash or "slot_version" not in stash:
        raise ExportError(f"--load: {directory} holds no sharded 2bw weight stash")
    return stash["slot_version"].index(stash["newest"] - 1)


def read_stash(load: str) -> None:
    """Every weight the export reads comes from the stash slot of the checkpoint `load` names."""
    prefix = f"weight_stash.slot{_stash_slot(checkpoint_reader.locate(load, None))}."
    checkpoint_stream._checkpoint_key = lambda sharded: prefix + sharded.key


if __name__ == "__main__":
    version, load, out = sys.argv[1:4]
    if version == "stash":
        read_stash(load)
    elif version != "live":
        sys.exit(f"version: live or stash, not {version}")
    export(load, out)

"""`megatron-async-export-hf` with the bytes of CPU tensors alive counted before each group is read.

    python -m tests.support.export_live_bytes LOAD OUT RESULT.json [--hold] [EXPORT FLAGS...]

Wraps the reader's `read_group`: before each read it sums the storage of every CPU tensor
the garbage collector can reach (each storage once), and records the group's own bytes as
read. A streaming export holds nothing of the groups before the one it reads; one that held
the model would show the earlier groups there. `--hold` keeps every group read (as an
export holding the whole model would), the control that the count sees held tensors.
"""

import gc
import json
import sys

import torch

from megatron_async.megatron_lm.export import checkpoint_stream
from megatron_async.megatron_lm.export.cli import export


def live_cpu_bytes() -> int:
    """Bytes of the CPU storages behind every tensor the garbage collector tracks."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def main() -> None:
    load, out, result = sys.argv[1:4]
    rest = sys.argv[4:]
    hold = "--hold" in rest
    rest = [a for a in rest if a != "--hold"]
    read = checkpoint_stream.read_group
    records, held = [], []

    def counted(*args):
        before = live_cpu_bytes()
        weights = read(*args)
        records.append({"live_before": before, "group_bytes": sum(t.untyped_storage().nbytes()
                                                                  for t in weights.values())})
        if hold:
            held.append(weights)
        return weights

    checkpoint_stream.read_group = counted
    shard = rest[rest.index("--max-shard-size") + 1] if "--max-shard-size" in rest else None
    export(load, out, **({"max_shard_size": shard} if shard else {}))
    with open(result, "w", encoding="utf-8") as f:
        json.dump(records, f)


if __name__ == "__main__":
    main()

"""A checkpoint save streams the weight stash to host memory: no copy of the weights on the GPU.

`WeightStashManager.state_dict` (the per-rank file of --ckpt-format torch) copies each
flat stash buffer straight to a new host tensor. Recorded on a real stash (a tiny GPT
in Megatron's DDP) with a dispatch mode that sees every tensor op the save runs: the
only ops are copies whose output is on the host, one per flat buffer, and the bytes
they produce are the stash's own bytes, the plan's `save_host` term
(megatron_async/planning/plan.py), while its GPU term `save_gpu` is zero. The same recorder
finds a device-side clone of the stash, what a save on the stash's device would run
(negative control).
"""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.support.multiprocess import run_distributed
from tests.support.tiny_gpt import TinyGPT


class _Recorder(TorchDispatchMode):
    """Every op that allocates a tensor (views, such as detach, allocate nothing)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        if isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() not in inputs:
            device = (kwargs or {}).get("device", out.device)
            self.ops.append((str(func.overloadpacket.__name__), str(torch.device(device)), out.nbytes))
        return out


def _save_entry(rank, world_size):
    from megatron_async.stash.weight_stash import WeightStashManager
    from tests.support.tiny_gpt import build

    model, _, _ = build(TinyGPT(num_layers=2))
    stash = WeightStashManager(model, depth=1)
    with _Recorder() as saved:
        state = stash.state_dict()
    with _Recorder() as cloned:  # a save on the stash's device
        [[flat.clone() for flat in slot] for slot in stash._slots]
    flats = [flat for slot in stash._slots for flat in slot]
    return {"ops": saved.ops, "clone_ops": cloned.ops, "flats": len(flats), "stash_bytes": stash.stash_bytes(),
            "aliases": any(t.data_ptr() == f.data_ptr() for slot in state["slots"] for t in slot for f in flats)}


def test_a_save_copies_the_stash_to_the_host_once_per_flat_buffer():
    (out,) = run_distributed(_save_entry, 1)
    assert [op for op, _device, _bytes in out["ops"]] == ["_to_copy"] * out["flats"], out["ops"]
    assert all(device == "cpu" for _op, device, _bytes in out["ops"])
    assert sum(nbytes for *_rest, nbytes in out["ops"]) == out["stash_bytes"] > 0
    assert not out["aliases"]
    # negative control: a device-side clone is what the recorder sees otherwise
    assert {op for op, _device, _bytes in out["clone_ops"]} == {"clone"}

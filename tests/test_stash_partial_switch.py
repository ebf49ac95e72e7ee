"""The stash points some parameters alone (`point_to(version, only=...)`, a node of Megatron's
combined step) without losing track of where the others point.

On a real stash (a tiny GPT in Megatron's DDP) two versions apart after one step, each
parameter's storage is read off its data pointer after sequences of partial and whole
switches: a partial switch moves its parameters alone; a whole switch after a partial one
moves them all back (it must not take the earlier whole switch's version as still held
everywhere); a partial switch after a whole one moves its parameters again (it must not
take a version recorded before the whole switch as still held); after the optimizer step
every parameter points at the live weights, and a partial switch moves its parameters
again (the versions recorded before the step no longer hold).
"""

from tests.support.multiprocess import run_distributed
from tests.support.tiny_gpt import TinyGPT


def _entry(rank, world_size):
    from megatron_async.stash.weight_stash import WeightStashManager
    from tests.support.tiny_gpt import build

    model, _, _ = build(TinyGPT(num_layers=2))
    stash = WeightStashManager(model, depth=1)
    with stash.optimizer_step():  # version 1 live, version 0 in the slot
        for p in stash.params:
            p.data.add_(1.0)
    n = len(stash.params)
    first, rest = tuple(range(0, n, 2)), tuple(range(1, n, 2))

    def where() -> list:
        """Each parameter's version, by the storage its data points at."""
        out = []
        for i, p in enumerate(stash.params):
            if p.data.data_ptr() == stash.live_storage(p).data_ptr():
                out.append(stash.newest)
            else:
                out.append(next(v for views, v in zip(stash.slot_views(), stash.slot_versions())
                                if views[i].data_ptr() == p.data.data_ptr()))
        return out

    seen = {}
    stash.point_to(1)
    stash.point_to(0, only=first)
    seen["partial"] = where()
    stash.point_to(1)
    seen["whole after partial"] = where()
    stash.point_to(0, only=first)
    seen["partial after whole"] = where()
    stash.point_to(1, only=first)  # every parameter at version 1, the live weights
    with stash.optimizer_step():  # version 2 live, version 1 in the slot
        pass
    seen["after the step"] = where()
    stash.point_to(1, only=first)
    seen["partial after the step"] = where()
    return {"n": n, "first": first, "seen": seen}


def test_a_partial_switch_moves_its_parameters_alone_and_whole_switches_move_all():
    (out,) = run_distributed(_entry, 1)
    n, first, seen = out["n"], set(out["first"]), out["seen"]
    assert n > 2
    assert seen["partial"] == [0 if i in first else 1 for i in range(n)]
    assert seen["whole after partial"] == [1] * n
    assert seen["partial after whole"] == seen["partial"]
    assert seen["after the step"] == [2] * n
    assert seen["partial after the step"] == [1 if i in first else 2 for i in range(n)]

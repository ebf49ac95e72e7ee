"""`python -m tests.support.gpu.save_memory_entry ARGS`: megatron_async.launch that
records what each weight-stash save adds to the GPU's peak memory
(tests/gpu/test_gpu_optimizer_options.py).

MEGATRON_ASYNC_TEST_SAVE_MEMORY=FILE: every `WeightStashManager.state_dict` call appends
{"allocated", "peak_added", "stash_bytes"} to FILE (one JSON line), where peak_added is
the GPU's peak during the call above what was allocated before it.
MEGATRON_ASYNC_TEST_SAVE_CLONE=1: the save also clones each flat stash buffer on the GPU,
as a save on the stash's device would (the negative control).
"""

import json
import os
import sys

import torch


def _record_saves(path: str, clone: bool) -> None:
    from megatron_async.stash.weight_stash import WeightStashManager

    state_dict = WeightStashManager.state_dict

    def recorded(self, *args, **kwargs):
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        clones = [[flat.clone() for flat in slot] for slot in self._slots] if clone else None
        state = state_dict(self, *args, **kwargs)
        torch.cuda.synchronize()
        peak_added = torch.cuda.max_memory_allocated() - allocated
        del clones
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"allocated": allocated, "peak_added": peak_added,
                                "stash_bytes": self.stash_bytes()}) + "\n")
        return state

    WeightStashManager.state_dict = recorded


if __name__ == "__main__":
    _record_saves(os.environ["MEGATRON_ASYNC_TEST_SAVE_MEMORY"],
                  os.environ.get("MEGATRON_ASYNC_TEST_SAVE_CLONE") == "1")
    from megatron_async.launch import main

    sys.exit(main())

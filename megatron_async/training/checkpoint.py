"""Save and resume through Megatron's distributed checkpointing.

A checkpoint is `SAVE/iter_NNNNNNN/` (a dist_checkpointing directory: sharded
model and optimizer state, the scheduler and iteration as common state, each
rank's RNG states as a sharded object) plus `SAVE/latest_checkpointed_iteration.txt`.
Loading restores all of it, so the iterations after a resume see the same
weights, optimizer moments, learning rate, data and RNG as an uninterrupted run.
"""

from __future__ import annotations

import argparse
import os
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron_async.per_rank_state import per_rank_object
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

TRACKER_FILE = "latest_checkpointed_iteration.txt"


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def latest_iteration(root: str) -> Optional[int]:
    path = os.path.join(root, TRACKER_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return int(f.read().strip())


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


class Checkpointer:
    """Saves to `--save` and resumes from `--load` for one model/optimizer/scheduler."""

    def __init__(self, args: argparse.Namespace, model, optimizer, scheduler, extra_state=None):
        self.args = args
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        # per-rank objects with state_dict()/load_state_dict() (e.g. the 2BW weight stash)
        self.extra_state = extra_state or {}

    def _modules(self) -> list:
        """The bare GPT modules: keys without DDP/Float16Module wrapper prefixes."""
        modules = []
        for chunk in self.model:
            while hasattr(chunk, "module"):
                chunk = chunk.module
            modules.append(chunk)
        return modules

    def _model_state(self) -> dict:
        modules = self._modules()
        if len(modules) == 1:
            return {"model": modules[0].sharded_state_dict()}
        return {f"model{i}": m.sharded_state_dict() for i, m in enumerate(modules)}

    def _sharded_state(self, iteration: int, is_loading: bool) -> dict:
        state = self._model_state()
        state["optimizer"] = self.optimizer.sharded_state_dict(state, is_loading=is_loading)
        state["scheduler"] = self.scheduler.state_dict()
        state["iteration"] = iteration
        state["rng_state"] = per_rank_object("rng_state", _rng_state())
        for name, obj in self.extra_state.items():
            state[name] = per_rank_object(name, obj.state_dict())
        return state

    def save(self, iteration: int) -> str:
        root = self.args.save
        path = checkpoint_dir(root, iteration)
        if dist.get_rank() == 0:
            os.makedirs(path, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(self._sharded_state(iteration, is_loading=False), path)
        dist.barrier()
        if dist.get_rank() == 0:
            with open(os.path.join(root, TRACKER_FILE), "w", encoding="utf-8") as f:
                f.write(str(iteration))
            print(f"saved checkpoint at iteration {iteration} to {path}", flush=True)
        dist.barrier()
        return path

    def load(self) -> int:
        """Restore the latest checkpoint under `--load`; returns its iteration (0 if none)."""
        iteration = latest_iteration(self.args.load)
        if iteration is None:
            if dist.get_rank() == 0:
                print(f"no checkpoint in {self.args.load}; starting from scratch", flush=True)
            return 0
        path = checkpoint_dir(self.args.load, iteration)
        loaded = dist_checkpointing.load(self._sharded_state(iteration, is_loading=True), path)
        modules = self._modules()
        if len(modules) == 1:
            modules[0].load_state_dict(loaded["model"])
        else:
            for i, module in enumerate(modules):
                module.load_state_dict(loaded[f"model{i}"])
        self.optimizer.load_state_dict(loaded["optimizer"])
        self.scheduler.load_state_dict(loaded["scheduler"])
        _set_rng_state(loaded["rng_state"])
        for name, obj in self.extra_state.items():
            obj.load_state_dict(loaded[name])
        if dist.get_rank() == 0:
            print(f"resumed from {path} at iteration {iteration}", flush=True)
        return int(loaded["iteration"])

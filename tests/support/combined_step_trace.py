"""Record what 2bw's combined forward-backward steps run, in order, beside the collective audit.

    MEGATRON_ASYNC_AUDIT_DIR=DIR torchrun ... -m tests.support.combined_step_trace --gpt ARGS...

The collective audit (tests/support/collective_audit.py: MEGATRON_ASYNC_AUDIT_DIR, no
injection; paused inside Megatron's checkpoint saves, where every rank meets by design) with,
in addition, on every rank in order:

- ("step", forward microbatch or None, backward microbatch or None) as each call of
  megatron_async.pipeline.combined_step.CombinedSteps.step starts;
- ("node", "F" or "B", microbatch, label, version) as each node of a plan starts its own
  forward or backward, where version is the one every weight the node may read (its
  layer's and those outside the layers) points at then, read off the stash's storages (the
  live one and each stashed slot), not the version the node was given; "mixed" where they
  point at more than one; NO_WEIGHTS for a node that may read none;
- ("read", microbatch, label, module, version, listed) as a module with weights of its own is
  called inside a node's forward (its forward pre-hook): the weights the node reads, found
  apart from the node's list of what it may read; version as above over that module's
  weights, listed whether the node's list holds them all;
- ("a2a", the node it is launched in, as (pass, microbatch, label), or None) for each
  torch.distributed.all_to_all_single (Megatron's expert all-to-all).

Each rank writes DIR/trace_rank<R>.json ({"stage", "microbatches", "events"}) when training ends.
"""

from __future__ import annotations

import functools
import json
import os
import sys

# inside: (pass, microbatch, label) of the node whose forward or backward runs now; nodes: the same nodes
_STATE = {"events": [], "inside": [], "nodes": [], "watched": False}


NO_WEIGHTS = "no weights"


def _version_of(stash, i: int) -> object:
    """The version whose storage the stash's parameter `i` points at now."""
    param = stash.params[i]
    ptr = param.data.data_ptr()
    if ptr == stash.live_storage(param).data_ptr():
        return stash.newest
    for views, version in zip(stash.slot_views(), stash.slot_versions()):
        if views[i].data_ptr() == ptr:
            return version
    return "none"


def _version_over(stash, positions) -> object:
    """The version the stash's parameters at `positions` all point at now, "mixed", or NO_WEIGHTS
    where there are none (a middle stage's pre-process node: no embedding there)."""
    if not positions:
        return NO_WEIGHTS
    seen = {_version_of(stash, i) for i in positions}
    return seen.pop() if len(seen) == 1 else "mixed"


def _version_seen(node) -> object:
    """The version every weight `node` may read points at now, or "mixed"."""
    return _version_over(node.stash, node.reads)


def _watch_reads(stash) -> None:
    """A forward pre-hook on every module of the stage with weights of its own: a "read" event
    when a node's forward calls it."""
    for chunk in stash.chunks:
        for name, module in chunk.named_modules():
            own = stash.indices_of(module.parameters(recurse=False))
            while name.startswith("module."):  # the wrappers' prefixes (DDP, Float16Module)
                name = name[len("module."):]
            if own:
                module.register_forward_pre_hook(functools.partial(_read, name, own))


def _read(name: str, own: tuple, _module, _inputs) -> None:
    if not _STATE["nodes"] or _STATE["inside"][-1][0] != "F":
        return
    node = _STATE["nodes"][-1]
    _STATE["events"].append(("read", node.microbatch, node.label, name, _version_over(node.stash, own),
                             set(own) <= set(node.reads)))


def _recorded(kind: str, node, original):
    @functools.wraps(original)
    def run(*args):
        _STATE["events"].append(("node", kind, node.microbatch, node.label, _version_seen(node)))
        _STATE["inside"].append((kind, node.microbatch, node.label))
        _STATE["nodes"].append(node)
        try:
            return original(*args)
        finally:
            _STATE["inside"].pop()
            _STATE["nodes"].pop()

    return run


def install(directory: str) -> None:
    import torch.distributed as dist
    import megatron.training.training as training

    from megatron_async.pipeline import combined_step

    init = combined_step.NodeAtVersion.__init__

    def traced_init(self, *args, **kwargs):
        init(self, *args, **kwargs)  # what runs after the node is pointed at its version
        if not _STATE["watched"]:
            _watch_reads(self.stash)
            _STATE["watched"] = True
        self._forward = _recorded("F", self, self._forward)
        self._backward = _recorded("B", self, self._backward)

    combined_step.NodeAtVersion.__init__ = traced_init
    step = combined_step.CombinedSteps.step

    def traced_step(self, forward, backward):
        _STATE["events"].append(("step", forward.microbatch if forward else None,
                                 backward.microbatch if backward else None))
        return step(self, forward, backward)

    combined_step.CombinedSteps.step = traced_step
    all_to_all = dist.all_to_all_single

    @functools.wraps(all_to_all)
    def traced_all_to_all(*args, **kwargs):
        _STATE["events"].append(("a2a", _STATE["inside"][-1] if _STATE["inside"] else None))
        return all_to_all(*args, **kwargs)

    dist.all_to_all_single = traced_all_to_all
    train = training.train

    @functools.wraps(train)
    def traced_train(*args, **kwargs):
        try:
            return train(*args, **kwargs)
        finally:
            _write(directory)

    training.train = traced_train


def _write(directory: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    record = {"stage": parallel_state.get_pipeline_model_parallel_rank(), "microbatches": get_num_microbatches(),
              "events": _STATE["events"]}
    with open(os.path.join(directory, f"trace_rank{dist.get_rank()}.json"), "w") as f:
        json.dump(record, f)


def main() -> int:
    from megatron_async import launch
    from megatron_async.megatron_lm.adapter.hooks import install as install_plugin
    from tests.support import collective_audit

    directory = os.environ["MEGATRON_ASYNC_AUDIT_DIR"]
    install_plugin()  # as the audit's entry: the plugin's hooks first
    collective_audit.install(directory)
    import megatron.training.training as training

    training.save_checkpoint_and_time = collective_audit.unrecorded(training.save_checkpoint_and_time)
    install(directory)
    return launch.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())

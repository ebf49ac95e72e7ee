"""The distributed optimizer's overlapped all-gather of the updated weights (`--overlap-param-gather`) under a delayed schedule.

With the overlap, Megatron's optimizer step writes each rank's shard of W(t+1) into
DDP's parameter buffer (the live weights) and leaves the all-gather of the rest to
the next forwards: each module's forward pre-hook waits for its bucket, and each
finished bucket dispatches the next. In 1F1B those forwards use W(t+1). Under 2bw
the forwards right after the step still run at W(t) from the stash (its storage, not
the buffer), and only trigger the gather into the live buffer, which overlaps them.

Every stage runs forwards between two steps, and every module's pre-hook waits for
its bucket, so by the next step the live weights are whole. `finish_param_gathers`
waits for a gather still in flight before the stash's snapshot and the step (a step
writing its shard under a running gather would be overwritten by it). The
tied-embedding link reads or overwrites one weight earlier: the first stage sends
its new weights right after the step, and the last stage installs the received ones
where a later gather of its own update would overwrite them; `gather_now` gathers
that weight's bucket first. Megatron marks a bucket as not dispatched when its
gradients are reduced, so "not dispatched" does not mean "not whole": only the stash,
which knows whether a forward ran since the step, decides to gather anew
(WeightStashManager.gather_update). The gathers run over each bucket's
data-parallel group only.

Megatron's layer-wise optimizer (`--optimizer muon --use-distributed-optimizer`, whose
DDP runs without the distributed optimizer's buffer layout) gathers into a separate
list and copies each gathered weight into `param.data`, wherever it points: during a
forward at the stashed version that is the stash's slot, which the copy would
overwrite with W(t+1) while the live weights stay partial. For that path
(`copies_through_params`) the stash gathers everything, with the parameters pointed at
the live weights, before its first forward at another version after a step: correct,
without that optimizer's overlap. Its gather also receives into the gradient buffer and
zeroes it when it lands, so none may run while that buffer holds gradients (from a
batch's first backward to its step) nor stay in flight across the step's zeroing of it:
a targeted gather starts no next bucket's.
"""

from __future__ import annotations


def _overlapped(chunk) -> bool:
    config = getattr(chunk, "ddp_config", None)
    return bool(config is not None and config.overlap_param_gather)


def overlapped(model_chunks) -> bool:
    """Whether a step leaves the gather of its update to the next forwards."""
    return any(_overlapped(c) for c in model_chunks)


def _groups(chunk) -> list:
    return list(chunk.bucket_groups) + list(chunk.expert_parallel_bucket_groups)


def finish_param_gathers(model_chunks) -> int:
    """Wait for the all-gathers of the live weights still in flight; returns how many."""
    finished = 0
    for chunk in model_chunks:
        if not _overlapped(chunk):
            continue
        for group in _groups(chunk):
            if group.param_gather_handle is not None:
                group.finish_param_sync(skip_next_bucket_dispatch=True)
                finished += 1
    return finished


def gather_now(model_chunks, params, dispatch_next: bool = True) -> None:
    """After a step: gather the buckets holding `params` now (unless a forward's pre-hook
    already did), each starting the next bucket's gather as a pre-hook would where
    `dispatch_next`."""
    for chunk in model_chunks:
        if not _overlapped(chunk):
            continue
        groups = {id(chunk.param_to_bucket_group[p]): chunk.param_to_bucket_group[p]
                  for p in params if p in chunk.param_to_bucket_group}
        for group in groups.values():
            if group.param_gather_handle is not None or not group.param_gather_dispatched:
                group.finish_param_sync(skip_next_bucket_dispatch=not dispatch_next)


def copies_through_params(model_chunks) -> bool:
    """Whether an overlapped gather copies into `param.data` (the layer-wise optimizer's
    variable-size gather) rather than into DDP's parameter buffer."""
    return any(_overlapped(c) and not c.ddp_config.use_distributed_optimizer for c in model_chunks)


def gather_all_now(model_chunks) -> None:
    """Dispatch every bucket's gather not yet dispatched and wait for all of them."""
    for chunk in model_chunks:
        if not _overlapped(chunk):
            continue
        for group in _groups(chunk):
            if group.param_gather_handle is not None or not group.param_gather_dispatched:
                group.finish_param_sync(skip_next_bucket_dispatch=True)

"""Turn off the per-batch weight caches that 2bw's interleaving would make stale.

Transformer Engine keeps, per module, a cached fp8 copy of each weight and
refreshes it in place only on a batch's first microbatch (`is_first_microbatch`,
which Megatron's schedule sets); with gradient-accumulation fusion the same flag
makes the first microbatch's backward overwrite `main_grad` instead of adding.
Under 2bw the next batch's first forward (at the new weights) runs before the
previous batch's last backwards, so those backwards, recomputes and evaluations
would read the next version's fp8 weights: silently wrong gradients.

Megatron's TE wrappers (TELinear, TELayerNormColumnParallelLinear, the grouped
linears; megatron/core/extensions/transformer_engine.py) pass
`is_first_microbatch=None` to TE when their `disable_parameter_transpose_cache`
is set, and TE then quantizes each forward's weight afresh from the parameter
(which the weight stash has pointed at the right version), saves that copy for
the backward, and always accumulates into `main_grad`. So 2bw sets that switch on
every module that has it. A module that takes `is_first_microbatch` but has no
such switch keeps a cache 2bw cannot turn off, and is refused by name.
"""

from __future__ import annotations

SWITCH = "disable_parameter_transpose_cache"
FIRST_MICROBATCH = "is_first_microbatch"


class WeightCacheError(RuntimeError):
    """A module caches weights per batch and offers no way to turn the cache off."""


def disable_first_microbatch_caches(model_chunks) -> int:
    """Set the switch on every module (and model config) that has it; return how many
    modules were switched. Raises WeightCacheError naming the first module that
    takes `is_first_microbatch` without the switch, before anything runs."""
    switched = 0
    for chunk in model_chunks:
        config = getattr(chunk, "config", None)
        if config is not None and hasattr(config, SWITCH):
            setattr(config, SWITCH, True)
        for name, module in chunk.named_modules():
            if hasattr(module, SWITCH):
                setattr(module, SWITCH, True)
                switched += 1
            elif hasattr(module, FIRST_MICROBATCH):
                shown = name.removeprefix("module.") or type(module).__name__
                raise WeightCacheError(
                    f"megatron-async: --pipeline-schedule 2bw: module {shown!r} ({type(module).__name__}) refreshes "
                    "a weight cache on each batch's first microbatch and has no disable_parameter_transpose_cache "
                    "switch; under 2bw the next batch's first forward runs before the previous batch's last "
                    "backwards, which would read the next weights. Use a layer without the cache, or a schedule "
                    "with a pipeline flush")
    return switched

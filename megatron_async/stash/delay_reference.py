"""`--simulated-delay`: which weight version each gradient is taken at, on one process.

`K` takes every gradient of step t at the weights of step t-K (K=1 is
PipeDream-2BW's rule, the reference a 2bw pipeline must equal). A list
`D0,...,D(P-1)` gives each of P would-be pipeline stages its own delay, with the
model split as a P-stage pipeline would split it (layers evenly, embedding on the
first stage, final norm and output layer on the last). `P-1,...,1,0` is original
PipeDream's: stage s updates once per microbatch and sees weights P-1-s steps old,
so delay grows towards the input. This lets the trainer compare 2BW's constant
one-step delay with PipeDream's variable delay without a P-process pipeline.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:  # the argument parser imports this module; keep it free of torch
    from megatron_async.stash.weight_stash import Version, WeightStashManager


def parse_delays(text: str) -> tuple[int, ...]:
    """argparse type: `K` or `D0,D1,...` -> a tuple of non-negative ints."""
    try:
        delays = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected K or D0,D1,... (integers), got {text!r}") from None
    if any(d < 0 for d in delays):
        raise argparse.ArgumentTypeError(f"delays must be >= 0, got {text!r}")
    return delays


def pipedream_delays(num_stages: int) -> tuple[int, ...]:
    """Original PipeDream's per-stage delays: stage s of P lags P-1-s steps."""
    return tuple(num_stages - 1 - s for s in range(num_stages))


def version_for_step(model_chunks, stash: WeightStashManager, delays: Sequence[int],
                     num_layers: int) -> Callable[[int], Version]:
    """A function iteration -> the weight version(s) its forward and backward use."""
    if len(set(delays)) == 1:
        delay = delays[0]
        return lambda iteration: max(iteration - delay, 0)
    from megatron_async.pipeline.grad_stats import stage_of_parameter

    names = {id(p): name for chunk in model_chunks for name, p in chunk.named_parameters()}
    per_param = [delays[stage_of_parameter(names[id(p)], num_layers, len(delays))] for p in stash.params]
    return lambda iteration: tuple(max(iteration - d, 0) for d in per_param)

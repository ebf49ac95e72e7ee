"""One pipeline stage as its runner and executor run it, in one object.

The runner (pipeline/two_bw.py) and the executors it makes (pipeline/executor.py), one
for training and one per evaluation, all run the same stage: its model chunk, the links
to its neighbour stages, its weight stash, Megatron's forward step, the shape of what
stages send each other and the run's process groups, which the pipeline code reads from
here rather than from Megatron's global parallel state. An evaluation runs the same stage on links of its own
(`dataclasses.replace(context, links=...)`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megatron_async.pipeline.p2p import StageLinks, stage_links
from megatron_async.stash.weight_stash import WeightStashManager


@dataclass(frozen=True)
class StageContext:
    model: torch.nn.Module  # this stage's model chunk (Megatron's DDP-wrapped module)
    links: StageLinks  # its neighbour stages and the group that reaches them
    stash: WeightStashManager  # the weight versions its forwards and backwards run at
    forward_step_func: Callable  # Megatron's forward step: (data_iterator, model) -> (output, loss_func)
    num_microbatches: int  # microbatches a batch
    activation_shape: tuple  # what a stage sends its neighbour
    dtype: torch.dtype  # and in which dtype
    device: torch.device  # where the stage computes
    groups: object  # the run's process groups (Megatron-Core's ProcessGroupCollection: pp, cp, ...)
    # Megatron's --overlap-moe-expert-parallel-comm: training passes run through its combined step
    combined_steps: bool = False


def stage_context(model: torch.nn.Module, stash: WeightStashManager, forward_step_func: Callable,
                  num_microbatches: int, activation_shape: tuple, dtype: torch.dtype, groups,
                  links: Optional[StageLinks] = None, combined_steps: bool = False) -> StageContext:
    """This rank's stage over the pipeline group of `groups` (or `links`), on its model's device."""
    return StageContext(model, links if links is not None else stage_links(groups.pp), stash, forward_step_func,
                        num_microbatches, activation_shape, dtype, next(model.parameters()).device, groups,
                        combined_steps)

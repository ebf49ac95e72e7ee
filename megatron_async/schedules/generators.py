"""Action-list generators by schedule name: (num_stages, microbatches, batches) -> lists.

Each returns one ordered action list per stage (see `actions`). The registry points
at these functions; `generate` is the short way to call one by name.
"""

from megatron_async.schedules.gen_2bw import min_microbatches_2bw, two_bw  # noqa: F401
from megatron_async.schedules.gen_2bw_paired import min_microbatches_2bw_paired, two_bw_paired  # noqa: F401
from megatron_async.schedules.gen_flush import gpipe, one_f_one_b_flush  # noqa: F401
from megatron_async.schedules.gen_interleaved import interleaved_1f1b, interleaved_1f1b_paired  # noqa: F401
from megatron_async.schedules.gen_pipedream import pipedream, pipedream_versions  # noqa: F401
from megatron_async.schedules.gen_zero_bubble import zb_h1, zbv  # noqa: F401

def generate(name: str, num_stages: int, microbatches: int, batches: int = 1, ep_overlap: bool = False):
    """Action lists of the registered schedule `name` (with `ep_overlap`: the ones it runs with
    Megatron's --overlap-moe-expert-parallel-comm)."""
    from megatron_async.schedules.registry import get_schedule_generator

    return get_schedule_generator(name, ep_overlap)(num_stages, microbatches, batches)

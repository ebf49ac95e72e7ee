"""Microbatches whose activations a pipeline stage holds at once, by schedule.

Under 1F1B and 2bw stage s holds p - s: its p-1-s warm-up forwards and the next
forward before the first backward frees one. 2bw with Megatron's
`--overlap-moe-expert-parallel-comm` runs a deeper warm-up, 2(p-1-s)+1 forwards
(schedules/gen_2bw_paired.py), and each combined step holds its new forward's
activations beside those of the backward it runs: 2(p-s), about 2p on stage 0. The
plan reads that count off the validator's replay of the lists the run would execute,
not off a formula, so a change to the generator shows in the plan.
"""

from __future__ import annotations

from megatron_async.megatron_lm.adapter import run_mode

# batches of the lists replayed: the warm-up fits in one batch (m >= 2p-1), and the first
# combined step after it is the peak
REPLAY_BATCHES = 2


def uses_combined_steps(args) -> bool:
    """The run's schedule is one of our runtime's (2bw) and would run its combined
    forward-backward lists: Megatron's --overlap-moe-expert-parallel-comm is set and the
    schedule registers such lists."""
    spec = run_mode.of(args).spec
    return (bool(getattr(args, "overlap_moe_expert_parallel_comm", False)) and spec.runtime is not None
            and spec.ep_overlap_generator is not None)


def microbatches_in_flight(args, microbatches: int) -> list[int]:
    """Per stage, the most microbatches whose activations it holds at once, for
    `microbatches` a batch (module docstring)."""
    p = args.pipeline_model_parallel_size
    if not uses_combined_steps(args):
        return [p - s for s in range(p)]
    from megatron_async.schedules.validator import validate

    lists = run_mode.of(args).spec.action_generator(ep_overlap=True)(p, microbatches, REPLAY_BATCHES)
    return validate(lists).max_inflight_microbatches

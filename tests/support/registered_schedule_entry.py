"""A schedule registered by a test, with a generator of its own, trained in Megatron's loop:
the launcher's entry after the registration, in every rank (`python -m` this module, with the
launcher's arguments).

The generator is 2bw's deeper warm-up (the combined steps' lists, schedules/gen_2bw_paired.py)
with each combined step run as its two passes: other lists than 2bw's, at 2bw's weight versions,
so the run must equal 2bw's one-step-delay twin. Each call appends a line to
$REGISTERED_SCHEDULE_LOG, so the test sees that the runner streamed these lists.
"""

from __future__ import annotations

import os
import runpy

NAME = "2bw-deep-warmup"


def deep_warmup(num_stages: int, microbatches: int, batches: int = 1) -> list:
    from megatron_async.schedules.actions import ForwardBackward
    from megatron_async.schedules.gen_2bw_paired import two_bw_paired

    log = os.environ.get("REGISTERED_SCHEDULE_LOG")
    if log:
        with open(log, "a", encoding="utf-8") as f:
            f.write(f"{os.environ.get('RANK', '?')} {num_stages} {microbatches} {batches}\n")
    lists = []
    for actions in two_bw_paired(num_stages, microbatches, batches):
        flat = []
        for a in actions:
            flat += [a.backward, a.forward] if isinstance(a, ForwardBackward) else [a]
        lists.append(flat)
    return lists


def register() -> None:
    from megatron_async.schedules.builtin import TWO_BW_RUNTIME
    from megatron_async.schedules.registry import register_schedule

    register_schedule(NAME, description="2bw's lists with the deeper warm-up (a test's schedule)",
                      generator="tests.support.registered_schedule_entry:deep_warmup", requires_pipeline=True, **TWO_BW_RUNTIME)


if __name__ == "__main__":
    register()
    runpy.run_module("megatron_async.launch", run_name="__main__", alter_sys=True)

"""Forward-only lists: an evaluation pass through the pipeline at one weight version.

Each stage receives a microbatch's activation from the previous stage, runs its
forward, and sends the output on, microbatch by microbatch: no backward, no step.
The executor runs these lists for evaluation as it runs training's, through
Megatron's forward step, on links of their own.
"""

from __future__ import annotations

from megatron_async.schedules.actions import Action, Forward, RecvActivation, SendActivation


def forward_only(num_stages: int, microbatches: int, version: int = 0) -> list[list[Action]]:
    """Per stage: [recv k, F k, send k] for every microbatch k (first stage: no receive,
    last stage: no send), all at `version`."""
    if num_stages < 1 or microbatches < 1:
        raise ValueError(f"a forward-only pass needs >= 1 stage and microbatch, got {num_stages} and {microbatches}")
    lists = []
    for s in range(num_stages):
        acts: list[Action] = []
        for k in range(microbatches):
            if s > 0:
                acts.append(RecvActivation(k, s - 1))
            acts.append(Forward(k, version))
            if s < num_stages - 1:
                acts.append(SendActivation(k, s + 1))
        lists.append(acts)
    return lists

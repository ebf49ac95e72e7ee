"""One line ahead of Megatron's first log line under 2bw: which gradient norm it shows.

Megatron prints its per-iteration line on the last rank, and under 2bw each stage clips
by its own gradient norm (docs/two_bw.md), so the `grad norm` of that line, and
--metrics-json's `grad_norm`, is the last stage's own, not the model's; with
--clip-grad-mode stale-global it is the previous step's global norm every stage clips
by. Megatron's line keeps its format (tools parse it); this line says which norm it is.
"""

from __future__ import annotations


def grad_norm_note(clip_grad_mode: str) -> str:
    """What the grad norm Megatron logs under 2bw is, for this clipping mode."""
    if clip_grad_mode == "stale-global":
        which = ("the global norm of the previous step, which every stage clips by (--clip-grad-mode stale-global; "
                 "the first step's is the last stage's own)")
    else:
        which = ("the last pipeline stage's own gradient norm, not the whole model's: each stage clips by its own "
                 "(--clip-grad-mode stage-local)")
    return f"megatron-async: --pipeline-schedule 2bw: the grad norm in Megatron's log line (and grad_norm in " \
           f"--metrics-json) is {which}"


def say_grad_norm_note(args) -> None:
    """On the rank that prints Megatron's log line (the last), once a run: the note."""
    import torch

    if torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
        print(grad_norm_note(args.clip_grad_mode), flush=True)

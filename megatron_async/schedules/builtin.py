"""Registrations of the schedules that ship with megatron_async and Megatron-Core."""

from megatron_async.schedules.registry import register_schedule

_MCORE = "megatron.core.pipeline_parallel.schedules:"

register_schedule(
    "no-pipelining",
    description="Megatron-Core: all microbatches on one stage, gradients accumulated",
    forward_backward_func=_MCORE + "forward_backward_no_pipelining",
)
register_schedule(
    "1f1b",
    description="Megatron-Core PipeDream-flush (1F1B) with a flush at every batch",
    forward_backward_func=_MCORE + "forward_backward_pipelining_without_interleaving",
    requires_pipeline=True,
)
register_schedule(
    "interleaved-1f1b",
    description="Megatron-Core interleaved 1F1B over virtual pipeline stages",
    forward_backward_func=_MCORE + "forward_backward_pipelining_with_interleaving",
    requires_pipeline=True,
)

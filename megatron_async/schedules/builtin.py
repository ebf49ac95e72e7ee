"""The schedules that ship with megatron_async and Megatron-Core, as data: the registry
registers them on first use (this module imports nothing of ours)."""

_MCORE = "megatron.core.pipeline_parallel.schedules:"
_GEN = "megatron_async.schedules.generators:"

# the layouts Megatron's get_forward_backward_func tells apart (ScheduleSpec.megatron_layout)
NO_PIPELINE, PIPELINE, VIRTUAL_PIPELINE = "no pipeline", "pipeline", "virtual pipeline"

# what 2bw's runtime needs: its runner, the class that drives it in Megatron's loop, the
# weight versions a stage keeps, and the flags it refuses (a schedule run by the same
# runtime registers these too)
TWO_BW_RUNTIME = dict(
    runtime="megatron_async.pipeline.two_bw:TwoBWRunner",
    stream="megatron_async.schedules.stream_2bw:TwoBWStream",
    run="megatron_async.megatron_lm.adapter.two_bw_run:TwoBWRun",
    weight_versions=2,
    flag_checks="megatron_async.megatron_lm.adapter.flags:check_2bw",
    flag_defaults="megatron_async.megatron_lm.adapter.flags:DEFAULTS_2BW",
)

BUILTIN_SCHEDULES = {
    "no-pipelining": dict(
        description="Megatron-Core: all microbatches on one stage, gradients accumulated",
        forward_backward_func=_MCORE + "forward_backward_no_pipelining",
        megatron_layout=NO_PIPELINE,
    ),
    "1f1b": dict(
        description="Megatron-Core PipeDream-flush (1F1B) with a flush at every batch",
        forward_backward_func=_MCORE + "forward_backward_pipelining_without_interleaving",
        requires_pipeline=True,
        generator=_GEN + "one_f_one_b_flush",
        megatron_layout=PIPELINE,
    ),
    "interleaved-1f1b": dict(
        description="Megatron-Core interleaved 1F1B over virtual pipeline stages",
        forward_backward_func=_MCORE + "forward_backward_pipelining_with_interleaving",
        generator=_GEN + "interleaved_1f1b",
        ep_overlap_generator=_GEN + "interleaved_1f1b_paired",
        requires_pipeline=True,
        megatron_layout=VIRTUAL_PIPELINE,
    ),
    "gpipe": dict(
        description="GPipe: all forwards, then all backwards, flush at every batch (action lists only)",
        generator=_GEN + "gpipe",
        requires_pipeline=True,
    ),
    "2bw": dict(
        description="PipeDream-2BW: 1F1B without flush, two weight versions, constant one-step delay",
        generator=_GEN + "two_bw",
        # simulated and validated; the runtime does not run combined steps, and check_2bw refuses the flag
        ep_overlap_generator=_GEN + "two_bw_paired",
        requires_pipeline=True,
        **TWO_BW_RUNTIME,
    ),
    "pipedream": dict(
        description="PipeDream: a step per microbatch, weight stashing, delay p-1-s at stage s",
        generator=_GEN + "pipedream",
        requires_pipeline=True,
    ),
    "zb-h1": dict(
        description="Zero bubble H1: 1F1B with the backward split into input and weight gradients "
                    "(action lists only)",
        generator=_GEN + "zb_h1",
        requires_pipeline=True,
    ),
    "zbv": dict(
        description="Zero bubble V: two model pieces per stage in a V, split backward (action lists only)",
        generator=_GEN + "zbv",
        requires_pipeline=True,
    ),
}

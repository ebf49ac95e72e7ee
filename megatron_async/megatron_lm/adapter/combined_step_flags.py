"""Megatron's --overlap-moe-expert-parallel-comm under a schedule of our runtime (2bw).

The flag makes a runtime run one microbatch's forward beside another's backward through
Megatron's combined step (pipeline/combined_step.py), so each pass's expert all-to-all
hides behind the other's compute. Megatron's TransformerConfig accepts the flag at PP > 1
only with virtual stages, because its only pipelined combined schedule is the interleaved
one; 2bw runs its own combined lists on one chunk per stage. So the plugin builds the
config with the flag cleared and sets it on the built config (`transformer_config`, a
hook of Megatron's core_transformer_config_from_args), and makes Megatron's other checks
for the flag itself (`check_combined_steps`), each naming the flag: skipping the
config's check must not skip those.
"""

from __future__ import annotations

import argparse
import copy
import functools
import inspect

from megatron_async.megatron_lm.adapter import run_mode
from megatron_async.megatron_lm.safety.failures import FlagError
from megatron_async.schedules.actions import Forward, OptimizerStep, passes

FLAG = "--overlap-moe-expert-parallel-comm"


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise FlagError(message)


def check_combined_steps(args: argparse.Namespace, schedule_flag: str) -> None:
    """Megatron's refusals of the flag (TransformerConfig's), and the schedule's own bound on
    the microbatches; each message names the flag."""
    mode = run_mode.of(args)
    if not mode.combined_steps:
        return
    head = f"{schedule_flag} with {FLAG}"
    generator = mode.schedule.action_generator(ep_overlap=True)
    _require(generator is not None, f"{head}: the schedule has no lists of combined forward-backward steps")
    p = args.pipeline_model_parallel_size
    m = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    try:
        lists = generator(p, m, 3)
    except ValueError as err:  # the generator's bound (2bw: m >= 2p-1), naming the flags
        raise FlagError(str(err)) from None
    fused_reduce = args.overlap_grad_reduce and args.gradient_accumulation_fusion
    _require(not fused_reduce or not _hooks_a_last_forward(lists, m),
             f"{head}, --overlap-grad-reduce and gradient-accumulation fusion need more microbatches per batch "
             f"(got {m}; 2bw: at least 2p = {2 * p}): with {m}, a batch's last forward runs before the previous "
             "step, and its backward's fused weights report to DDP from autograd's CPU thread while the device "
             "thread starts bucket reductions (stash/fused_wgrad.py). Raise --global-batch-size, or pass "
             "--no-gradient-accumulation-fusion")
    _require((args.mtp_num_layers or 0) <= 1,
             f"{head}: --mtp-num-layers {args.mtp_num_layers}: the combined step runs at most one multi-token "
             "prediction layer (Megatron refuses more)")
    from megatron.core.utils import is_torch_min_version

    _require(is_torch_min_version("2.6.0"), f"{head} needs torch >= 2.6 (Megatron: its all-to-all overlap hangs "
                                            "with older versions)")
    _require((args.expert_model_parallel_size or 1) > 1,
             f"{head}: there is no expert all-to-all to overlap without expert parallelism; set "
             "--expert-model-parallel-size > 1")
    _require(args.moe_token_dispatcher_type in ("alltoall", "flex"),
             f"{head} needs --moe-token-dispatcher-type alltoall or flex (got {args.moe_token_dispatcher_type}): "
             "Megatron's combined step splits only those dispatchers into their own nodes")
    recompute = [(args.recompute_granularity == "full", "--recompute-granularity full"),
                 (args.recompute_method is not None, f"--recompute-method {args.recompute_method}"),
                 (args.recompute_num_layers is not None, f"--recompute-num-layers {args.recompute_num_layers}"),
                 ("moe" in (args.recompute_modules or ()), "--recompute-modules moe")]
    for refused, given in recompute:
        _require(not refused, f"{head}: {given} recomputes inside a layer the combined step runs node by node "
                              "(Megatron refuses it too)")
    _require(bool(args.bf16), f"{head} needs --bf16 (Megatron runs the combined step only in bf16 or fp16, and 2bw "
                              "refuses --fp16)")
    _require(not args.moe_shared_expert_overlap,
             f"{head}: --moe-shared-expert-overlap overlaps the shared experts on a stream of its own, which the "
             "combined step replaces (Megatron refuses the two together)")
    _require(not getattr(args, "ep_overlap_early_attn_memory_release", False),
             f"{head}: --ep-overlap-early-attn-memory-release is checked by Megatron's TransformerConfig against "
             f"{FLAG}, which the plugin keeps out of that config under {schedule_flag} (the config would ask for "
             "virtual stages): drop it")


def check_forward_step(forward_step_func) -> None:
    """Megatron's combined step calls the forward step with return_schedule_plan=True (for the
    model's schedule plan, GPTModel.build_schedule_plan): refuse one that takes no such
    argument where the runner starts, before its first pass, naming the flag."""
    params = inspect.signature(forward_step_func).parameters.values()
    if any(p.name == "return_schedule_plan" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return
    name = getattr(forward_step_func, "__qualname__", repr(forward_step_func))
    raise FlagError(f"{FLAG} runs each pass through Megatron's combined step, which calls the forward step with "
                    f"return_schedule_plan=True for the model's schedule plan (GPTModel.build_schedule_plan); "
                    f"the forward step {name} takes no such argument: add `return_schedule_plan=False` to it "
                    f"(Megatron-LM's pretrain_gpt.py forward_step has it), or drop {FLAG}")


def _hooks_a_last_forward(lists, m: int) -> bool:
    """Whether some stage runs a batch's last forward before the previous batch's optimizer step:
    under the stash's saved-tensor hooks then (pipeline/executor.py), and that forward's
    backward is the one after which DDP reduces."""
    for acts in lists:
        done = -1  # the last optimizer step run
        for action in acts:
            if isinstance(action, OptimizerStep):
                done = action.step
                continue
            if any(isinstance(x, Forward) and x.microbatch % m == m - 1 and x.microbatch // m > done + 1
                   for x in passes(action)):
                return True
    return False


def transformer_config(original):
    """Megatron's core_transformer_config_from_args: under a schedule of ours with the flag, the
    config built with the flag cleared (no demand for virtual stages), then set on it."""

    @functools.wraps(original)
    def hooked(args, *rest, **kwargs):
        if not run_mode.of(args).combined_steps:
            return original(args, *rest, **kwargs)
        cleared = copy.copy(args)
        cleared.overlap_moe_expert_parallel_comm = False
        config = original(cleared, *rest, **kwargs)
        config.overlap_moe_expert_parallel_comm = True
        return config

    return hooked

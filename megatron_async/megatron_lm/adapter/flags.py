"""Our flags inside Megatron's own argument parser, and their checks.

`add_arguments` appends a "megatron-async" group to every parser Megatron builds
(so `--help` lists it); `validate` runs after Megatron's validate_args and refuses,
before any process group exists, what 2bw or a simulated delay cannot honour, each
message naming the flag.
"""

from __future__ import annotations

import argparse
import re

from megatron_async.megatron_lm.adapter import run_mode
from megatron_async.stash.delay_reference import parse_delays
from megatron_async.megatron_lm.safety.failures import FlagError  # noqa: F401 - raised here, caught by name elsewhere
from megatron_async.schedules.registry import available_schedules



def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("megatron-async")
    g.add_argument("--pipeline-schedule", default=None, metavar="{" + ",".join(available_schedules()) + "}",
                   help="2bw: PipeDream-2BW (no pipeline flush, two weight versions, one-step delay); "
                        "default: Megatron's own schedule")
    g.add_argument("--simulated-delay", type=parse_delays, default=(0,), metavar="K|D0,...,DP-1",
                   help="PP=1: compute the gradient of step t at the weights of step max(t-K, 0); K=1 is the "
                        "reference 2bw must equal. A list gives each of P would-be stages its own delay")
    g.add_argument("--simulated-pipeline-stages", type=int, default=None, metavar="P",
                   help="with --simulated-delay: clip each of P would-be pipeline stages by its own norm")
    g.add_argument("--clip-grad-mode", default="stage-local", choices=["stage-local", "stale-global"],
                   help="2bw: stage-local clips each stage by its own gradient norm; stale-global clips step t by "
                        "the global norm of step t-1, from a non-blocking all-reduce started at step t-1")
    g.add_argument("--delay-correction", default="none", choices=["none", "ef", "dc-asgd", "predict", "nesterov"],
                   help="ef: apply D_t + lambda (D_t - D_{t-1}) instead of the optimizer's update D_t; dc-asgd: "
                        "g + lambda_t g*g*D_{t-1} (delay compensation); predict: run microbatches at "
                        "W + alpha (W - W_prev); nesterov: g + beta (g - g_prev), the optimizer's momentum "
                        "becomes Nesterov's look-ahead (docs/delay_correction.md)")
    g.add_argument("--ef-lambda", type=float, default=1.0, help="lambda of --delay-correction ef")
    g.add_argument("--dc-lambda", type=float, default=1.0,
                   help="lambda_0 of --delay-correction dc-asgd (lambda_t = lambda_0 / sqrt(mean square of g))")
    g.add_argument("--prediction-alpha", type=float, default=1.0,
                   help="alpha of --delay-correction predict (1: the last update applied once more)")
    g.add_argument("--nesterov-beta", type=float, default=None,
                   help="beta of --delay-correction nesterov (default: the optimizer's own momentum: "
                        "--adam-beta1, --muon-momentum or --sgd-momentum)")
    g.add_argument("--layout-invariant-init", action="store_true",
                   help="seed every weight by --seed and its global name, so any TP/PP/EP layout starts equal")
    g.add_argument("--metrics-json", default=None, metavar="PATH",
                   help="one JSON object per iteration (loss, lr, grad norm, s/iter) and evaluation, next to "
                        "TensorBoard (replaced by a fresh run, appended to by a resumed one)")
    g.add_argument("--rank-stats-dir", default=None, metavar="DIR",
                   help="every rank writes DIR/rank<R>.jsonl each --log-interval: its mean s/iter, RSS and "
                        "pending point-to-point sends (no collective)")
    g.add_argument("--plot", default=None, metavar="PNG",
                   help="with --metrics-json: train and validation loss, drawn when training ends")
    g.add_argument("--no-checkpoint-checksums", action="store_true",
                   help="neither take checksums of a torch_dist checkpoint's files at save (each rank hashes "
                        "the files it wrote) nor check them at load, where a changed file is refused")
    _escape_percent_in_help(parser)
    _mark_defaults_2bw_replaces(parser)
    _exit_signal_by_name_or_number(parser)
    _errors_in_one_line(parser)
    return parser


def _errors_in_one_line(parser: argparse.ArgumentParser) -> None:
    """argparse prints its usage before an error (an unknown flag, a value outside a flag's
    choices): Megatron's runs to some thousand lines on every rank and buries the line that
    says what is wrong. Only that line, under the program the user ran (argparse's prog), exit 2."""

    def error(message: str):
        parser.exit(2, f"{parser.prog}: error: {message} (--help lists every flag)\n")

    parser.error = error


def _exit_signal_by_name_or_number(parser: argparse.ArgumentParser) -> None:
    """Megatron reads --exit-signal as a signal's name (SIGTERM) and crashes with a
    KeyError on anything else, a number included; take the number too, and refuse any
    other value with argparse's own one-line error, naming the flag."""
    import signal

    for action in parser._actions:
        if "--exit-signal" not in action.option_strings:
            continue

        def by_name_or_number(text: str) -> signal.Signals:
            try:
                return signal.Signals(int(text)) if text.lstrip("-").isdigit() else signal.Signals[text]
            except (KeyError, ValueError):
                raise argparse.ArgumentTypeError(
                    f"{text!r} is no signal: give its name (SIGTERM, SIGINT, SIGUSR1, ...) or its number") from None

        by_name_or_number.__name__ = "signal"
        action.type = by_name_or_number


# Megatron flags whose default 2bw cannot run with, and what 2bw sets instead when the user
# left them at that default (a value set explicitly is still refused, naming the flag).
DEFAULTS_2BW = (
    ("rerun_mode", "--rerun-mode", "validate_results", "disabled",
     "Megatron's rerun state machine all-reduces over all ranks every iteration"),
)

def _mark_defaults_2bw_replaces(parser: argparse.ArgumentParser) -> None:
    """Parse DEFAULTS_2BW's flags with a default of None, so that resolve_defaults can tell a
    value the user typed from Megatron's default."""
    for action in parser._actions:
        for dest, _, megatron_default, value_2bw, _ in DEFAULTS_2BW:
            if action.dest == dest and action.default == megatron_default:
                action.default = None
                if isinstance(action.help, str):
                    action.help += f" (default: {megatron_default}; megatron-async: {value_2bw} under 2bw)"


def resolve_defaults(args: argparse.Namespace) -> None:
    """Before Megatron's validate_args: a flag of DEFAULTS_2BW the user did not set (None, as
    _mark_defaults_2bw_replaces parses it) gets Megatron's default, or under 2bw the value 2bw
    needs (the rows its spec names, ScheduleSpec.flag_defaults), with a one-line notice."""
    mode = run_mode.of(args)
    replaced = mode.schedule.default_rows()
    for row in DEFAULTS_2BW:
        dest, flag, megatron_default, value_2bw, why = row
        if not hasattr(args, dest) or getattr(args, dest) is not None:
            continue
        if row in replaced:
            setattr(args, dest, value_2bw)
            if getattr(args, "rank", 0) == 0:
                print(f"megatron-async: {_schedule_flag(mode)} sets {flag} {value_2bw} ({why})",
                      flush=True)
        else:
            setattr(args, dest, megatron_default)


_PERCENT = re.compile(r"%%|%\(\w+\)[a-z]|%")  # an escaped %, a format field, or a bare %


def _escape_percent_in_help(parser: argparse.ArgumentParser) -> None:
    """argparse formats help with %; one Megatron-Core 0.19.2 help text has a bare '%)'
    that makes `--help` raise, so bare percent signs are escaped."""
    for action in parser._actions:
        if isinstance(action.help, str):
            action.help = _PERCENT.sub(lambda m: m.group(0) if len(m.group(0)) > 1 else "%%", action.help)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise FlagError(message)


# Megatron flags whose per-iteration collective spans pipeline stages, with why.
REFUSED_UNDER_2BW = (
    ("rerun_mode", lambda v: v != "disabled", "--rerun-mode",
     "must be disabled (the default under 2bw): the rerun state machine all-reduces over all ranks every "
     "iteration"),
    ("log_params_norm", bool, "--log-params-norm", "all-reduces the parameter norm across stages every iteration"),
    ("log_straggler", bool, "--log-straggler", "gathers timings over all ranks"),
    ("timing_log_level", lambda v: (v or 0) >= 1, "--timing-log-level",
     "levels >= 1 time with barriers and gather timers over all ranks"),
    ("calculate_per_token_loss", bool, "--calculate-per-token-loss",
     "broadcasts the batch token count across stages every step"),
    ("fp16", bool, "--fp16", "its loss scaling skips steps on an inf/nan check across stages; use --bf16"),
    ("rampup_batch_size", lambda v: v is not None, "--rampup-batch-size",
     "changes the microbatch count during training; 2bw's pipeline spans batches"),
    ("step_batch_size_schedule", lambda v: v is not None, "--step-batch-size-schedule",
     "changes the microbatch count during training; 2bw's pipeline spans batches"),
    ("use_megatron_fsdp", bool, "--use-megatron-fsdp",
     "shards the weights, while 2bw's stash swaps whole parameter storages between two versions"),
    ("async_save", bool, "--async-save",
     "finalizes a pending save with a blocking collective over all ranks every iteration "
     "(maybe_finalize_async_save), and 2bw's stages run up to a step apart; save synchronously"),
    ("cuda_graph_impl", lambda v: v not in (None, "none"), "--cuda-graph-impl",
     "captured graphs keep the storage of the weights they captured, while 2bw switches weight versions"),
)

# Megatron flags whose kernels or schedule hooks 2bw would silently bypass or get wrong, with why.
_STASH_WHY = ("whose storage the weight stash cannot point at another version: backwards after the next "
              "step would read the live weights")
_OFFLOAD_WHY = ("installs its own saved-tensor hooks, which replace the weight stash's (PyTorch applies the "
                "innermost), so a weight view saved before a step would not be rebuilt at its version")
_P2P_WHY = "tunes Megatron's own point-to-point code, which 2bw does not use (it posts one isend/irecv per transfer)"
SILENTLY_WRONG_UNDER_2BW = (
    ("fp8_param_gather", bool, "--fp8-param-gather", "keeps the weights as fp8 tensors " + _STASH_WHY),
    ("fp4_param_gather", bool, "--fp4-param-gather", "keeps the weights as fp4 tensors " + _STASH_WHY),
    ("delay_wgrad_compute", bool, "--delay-wgrad-compute",
     "makes Transformer Engine's layers defer weight gradients to backward_dw() (DDP's gradient hooks fire "
     "there), moving them away from where 2bw hands out the fused-wgrad dummy gradients of each node; not "
     "checked under 2bw"),
    ("overlap_dispatch_backward_with_experts_wgrad", bool, "--overlap-dispatch-backward-with-experts-wgrad",
     "defers expert weight gradients into Megatron's combined 1F1B schedule, which 2bw replaces"),
    ("defer_embedding_wgrad_compute", bool, "--defer-embedding-wgrad-compute",
     "defers the output layer's weight-gradient GEMMs to Megatron's pipeline flush, which 2bw does not have: "
     "they would never be computed"),
    ("cpu_offloading_num_layers", lambda v: (v or 0) > 0, "--cpu-offloading-num-layers", _OFFLOAD_WHY),
    ("fine_grained_activation_offloading", bool, "--fine-grained-activation-offloading", _OFFLOAD_WHY),
    ("save_wgrads_interval", lambda v: v is not None, "--save-wgrads-interval",
     "asks Megatron's schedule for all-reduced gradients (force_all_reduce), which 2bw's gradient "
     "finalisation does not honour: the dump would hold reduce-scattered ones"),
    ("use_ring_exchange_p2p", bool, "--use-ring-exchange-p2p", _P2P_WHY),
    ("overlap_p2p_comm_warmup_flush", bool, "--overlap-p2p-communication-warmup-flush", _P2P_WHY),
)


def validate_first(args: argparse.Namespace) -> None:
    """Before Megatron's validate_args: the run's mode, resolved once (run_mode.py), the
    defaults 2bw replaces, and the flags Megatron checks with a bare assert."""
    run_mode.hold(args, run_mode.resolve(args))
    resolve_defaults(args)
    _require(not getattr(args, "save", None) or getattr(args, "save_interval", None) is not None,
             f"--save {getattr(args, 'save', None)} needs --save-interval N, the iterations between checkpoints "
             "(Megatron has no default); e.g. --save-interval 1000")
    _require(getattr(args, "save_interval", None) is None or args.save_interval > 0,
             f"--save-interval must be > 0 (got {getattr(args, 'save_interval', None)})")


def validate(args: argparse.Namespace) -> argparse.Namespace:
    """Check our flags against Megatron's (after Megatron's validate_args filled derived values)."""
    mode = run_mode.of(args)
    _check_simulated_delay(args, mode)
    _check_delay_correction(args, mode)
    _check_optimizer(args)
    _check_low_precision(args)
    _check_data(args)
    _check_checkpoints(args, mode)
    if mode.stash_depth:
        _require(not getattr(args, "optimizer_cuda_graph", False),
                 f"{_schedule_flag(mode) if not mode.simulated else '--simulated-delay'}: "
                 "--optimizer-cuda-graph replays a captured optimizer step, which skips the weight stash's save "
                 "of the live weights and the delay correction's hooks (Python code a graph replay never runs), "
                 "and its capture synchronises the device between all-rank barriers")
    _require(args.clip_grad_mode == "stage-local" or mode.schedule.run is not None,  # our runner clips stale-global
             "--clip-grad-mode stale-global needs --pipeline-schedule 2bw")
    if mode.name is None:
        return args
    pp = args.pipeline_model_parallel_size
    spec = mode.schedule
    if spec.run is not None:
        spec.check_flags(args)
    else:
        _require(spec.forward_backward_func is not None,
                 f"{_schedule_flag(mode)} can only be simulated (megatron-async-simulate)")
        from megatron_async.schedules.registry import megatron_schedule

        layout = megatron_layout(args)
        _require(spec.megatron_layout == layout,
                 f"--pipeline-schedule {mode.name!r}: with --pipeline-model-parallel-size {pp} and "
                 f"{'' if args.virtual_pipeline_model_parallel_size else 'no '}virtual stages Megatron runs "
                 f"{megatron_schedule(layout)!r}")
    return args


def _check_low_precision(args: argparse.Namespace) -> None:
    """fp8 and fp4 live in Transformer Engine's layers: with Megatron's local layers, or with
    no Transformer Engine installed, Megatron trains in full precision without a word."""
    for flag, value in (("--fp8-format", getattr(args, "fp8", None)), ("--fp4-format", getattr(args, "fp4", None))):
        if not value:
            continue
        _require(args.transformer_impl == "transformer_engine",
                 f"{flag} {value}: only Transformer Engine's layers compute in {flag[2:5]}, and this run uses "
                 f"--transformer-impl {args.transformer_impl}, so it would train in full precision without a word")
        try:
            import transformer_engine  # noqa: F401
        except ImportError:
            _require(False, f"{flag} {value} needs Transformer Engine, which is not installed here: Megatron "
                            "would train in full precision without a word")


def _check_simulated_delay(args: argparse.Namespace, mode: run_mode.RunMode) -> None:
    pp, stages, delays = args.pipeline_model_parallel_size, mode.simulated_stages, mode.delays
    _require(stages >= 1, f"--simulated-pipeline-stages must be >= 1 (got {stages})")
    _require(len(delays) == 1 or len(delays) == stages,
             f"--simulated-delay lists {len(delays)} stage delays but --simulated-pipeline-stages is {stages}")
    if max(delays) > 0:
        _require(mode.schedule.run is None,
                 f"--simulated-delay cannot be combined with {_schedule_flag(mode)}, whose delay is real")
        _require(pp == 1, f"--simulated-delay needs --pipeline-model-parallel-size 1 (got {pp}); "
                          "use --pipeline-schedule 2bw with PP > 1")
        _require(not args.calculate_per_token_loss,
                 "--simulated-delay does not support --calculate-per-token-loss (2bw cannot honour it either)")
    if stages > 1:
        _require(max(delays) > 0, "--simulated-pipeline-stages needs --simulated-delay")
        _require(args.num_layers % stages == 0,
                 f"--num-layers ({args.num_layers}) is not divisible by the {stages} stages of "
                 "--simulated-pipeline-stages / --simulated-delay")


def _check_delay_correction(args: argparse.Namespace, mode: run_mode.RunMode) -> None:
    """A correction needs a delay to correct, and dc-asgd / predict model exactly one step."""
    name = args.delay_correction
    if name == "none":
        return
    _require(mode.stash_depth > 0, f"--delay-correction {name} needs a delayed gradient: "
                                   "--pipeline-schedule 2bw or --simulated-delay")
    if name in ("dc-asgd", "predict"):
        _require(set(mode.delays) == {1} if mode.simulated else mode.stash_depth == 1,
                 f"--delay-correction {name} models a one-step delay (2bw, --simulated-delay 1); "
                 f"got --simulated-delay {','.join(map(str, mode.delays))}")
    if name in ("ef", "dc-asgd", "nesterov"):  # they act on the torch optimizer's .grad and main parameters
        offload = " (which --optimizer-cpu-offload needs)" if getattr(args, "optimizer_cpu_offload", False) else ""
        _require(not getattr(args, "use_precision_aware_optimizer", False),
                 f"--delay-correction {name} with --use-precision-aware-optimizer{offload}: Transformer Engine's "
                 "FusedAdam takes the gradients from .decoupled_grad and keeps the fp32 master weights inside "
                 "itself, where the correction cannot reach them, so it would silently do nothing; drop one of "
                 "the two flags")
    _require(args.dc_lambda >= 0.0, f"--dc-lambda must be >= 0 (got {args.dc_lambda})")
    _require(args.prediction_alpha >= 0.0, f"--prediction-alpha must be >= 0 (got {args.prediction_alpha})")
    if name == "nesterov":
        _require(not getattr(args, "muon_nesterov", False),
                 "--delay-correction nesterov with --muon-nesterov would apply Nesterov's look-ahead twice")
        beta = nesterov_beta(args)
        _require(0.0 <= beta < 1.0, f"--nesterov-beta must be in [0, 1) (got {beta})")


def nesterov_beta(args: argparse.Namespace) -> float:
    """--nesterov-beta, or the momentum coefficient of the optimizer it corrects."""
    if args.nesterov_beta is not None:
        return args.nesterov_beta
    if "muon" in args.optimizer:
        return args.muon_momentum
    if args.optimizer == "sgd":
        return args.sgd_momentum
    return args.adam_beta1


def _check_optimizer(args: argparse.Namespace) -> None:
    """What Megatron would only find when it builds the optimizer, after the process groups."""
    _require(args.lr is not None or args.skip_train, "--lr is required (Megatron has no default learning rate)")
    _require(args.ef_lambda >= 0.0, f"--ef-lambda must be >= 0 (got {args.ef_lambda})")
    from megatron_async.megatron_lm.adapter.optimizer_probe import failure

    broken = failure(args.optimizer)
    _require(broken is None, f"--optimizer {args.optimizer!r} fails its first step with the installed "
                             f"emerging-optimizers ({broken})")
    if "muon" not in args.optimizer:
        return
    _require(args.muon_num_ns_steps >= 1, f"--muon-num-ns-steps must be >= 1 (got {args.muon_num_ns_steps})")
    layer_wise = getattr(args, "use_layer_wise_distributed_optimizer", False)
    _require(not layer_wise or args.bf16 or args.fp16,
             f"--optimizer {args.optimizer} with --use-distributed-optimizer runs Megatron's layer-wise optimizer, "
             "which Megatron-Core 0.19.2 drives only in mixed precision: in fp32 it fails at the first step "
             "('TensorParallelMuon' has no get_loss_scale); add --bf16, or drop --use-distributed-optimizer")
    try:
        from megatron.core.optimizer.emerging_optimizers import get_supported_coefficient_types

        types = [t for t in get_supported_coefficient_types() if t != "custom"]
    except (ImportError, AssertionError):
        return
    _require(args.muon_coefficient_type in types,
             f"--muon-coefficient-type {args.muon_coefficient_type!r} is not available; choose one of: "
             f"{', '.join(types)}")


def megatron_layout(args: argparse.Namespace) -> str:
    """The layout Megatron's get_forward_backward_func tells apart (ScheduleSpec.megatron_layout)."""
    from megatron_async.schedules.builtin import NO_PIPELINE, PIPELINE, VIRTUAL_PIPELINE

    if args.pipeline_model_parallel_size == 1:
        return NO_PIPELINE
    return VIRTUAL_PIPELINE if args.virtual_pipeline_model_parallel_size else PIPELINE


def check_2bw(args: argparse.Namespace) -> None:
    """What 2bw's runtime refuses (its ScheduleSpec.flag_checks), each naming the flag."""
    from megatron_async.schedules.gen_2bw import min_microbatches_2bw

    pp = args.pipeline_model_parallel_size
    mode = run_mode.of(args)
    flag = _schedule_flag(mode)
    _require(pp > 1 or not mode.schedule.requires_pipeline,
             f"{flag} needs --pipeline-model-parallel-size > 1 (at PP=1 use --simulated-delay 1)")
    m = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    bound = min_microbatches_2bw(pp)
    _require(m >= bound, f"{flag} with {pp} stages needs at least {bound} microbatches per batch "
                         f"(--global-batch-size / (--micro-batch-size x data-parallel size) = {m})")
    _require(m >= pp or not (args.overlap_grad_reduce and args.gradient_accumulation_fusion),
             f"{flag} with --overlap-grad-reduce and gradient-accumulation fusion needs at least as many "
             f"microbatches per batch as stages ({m} < {pp}): with fewer, the first stage runs a batch's last "
             "forward before the previous step, and its backward's fused weights report to DDP from autograd's "
             "CPU thread while the device thread starts bucket reductions (stash/fused_wgrad.py). Raise "
             "--global-batch-size, or pass --no-gradient-accumulation-fusion")
    _require(not args.virtual_pipeline_model_parallel_size,
             f"{flag} does not support virtual pipeline stages "
             "(--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank)")
    copies_embeddings = not args.untie_embeddings_and_output_weights or bool(args.mtp_num_layers)
    _require(not copies_embeddings or args.delay_correction != "predict",
             f"{flag}: --delay-correction predict needs --untie-embeddings-and-output-weights "
             "and no --mtp-num-layers: the last stage's copy of the word embeddings is the first stage's, sent "
             "after its step, and a prediction from the last stage's own weights would extrapolate from a "
             "discarded update")
    _require(not (copies_embeddings and args.save_params_interval),
             f"{flag}: --save-params-interval with tied embeddings or --mtp-num-layers would dump "
             "the last stage's copy of the word embeddings right after its own step, an update 2bw discards "
             "(it installs the first stage's weights before the next step)")
    _require(not args.mtp_num_layers or not args.pipeline_model_parallel_layout,
             f"{flag}: --pipeline-model-parallel-layout with --mtp-num-layers: the MTP layers must "
             "stay on the last stage, whose copy of the word embeddings the tied-embedding link keeps")
    _require(args.clip_grad_mode == "stage-local" or args.clip_grad > 0,
             "--clip-grad-mode stale-global needs --clip-grad > 0")
    for name, refused, refused_flag, why in REFUSED_UNDER_2BW + SILENTLY_WRONG_UNDER_2BW:
        _require(not refused(getattr(args, name, None)), f"{flag}: {refused_flag} {why}")
    from megatron_async.megatron_lm.adapter.combined_step_flags import check_combined_steps

    check_combined_steps(args, flag)  # --overlap-moe-expert-parallel-comm: Megatron's checks, made here


def _schedule_flag(mode: run_mode.RunMode) -> str:
    """How a message names the schedule the user picked."""
    return f"--pipeline-schedule {mode.name}"


def _check_checkpoints(args: argparse.Namespace, mode: run_mode.RunMode) -> None:
    from megatron_async.megatron_lm.safety.resume_checks import check_checkpoints

    check_checkpoints(args, stash=mode.stash_depth > 0)


def _check_data(args: argparse.Namespace) -> None:
    from megatron_async.data.errors import DataError
    from megatron_async.data.flag_checks import check_data_flags

    try:
        check_data_flags(args)
    except DataError as err:
        raise FlagError(str(err)) from None

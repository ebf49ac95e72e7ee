"""Every Megatron name the plugin hooks, in one table, and `install()`.

Each Hook (a megatron_async/patch_table.py Patch) names a module attribute that Megatron
looks up at call time, the line of Megatron-Core 0.19.2 (= Megatron-LM core_r0.19.0,
f8837c04) that calls it, how it is wrapped and its scope: every run, delayed runs only, or
CPU only (outside its scope a hook calls Megatron's function unchanged). `install()` checks
that every name exists before changing anything, and fails naming the missing one on
another Megatron version; `uninstall()` puts Megatron's functions back. The other tables:
the CUDA and NCCL emulation (cpu.py, cpu_nccl.py) and the patches a delayed run installs
for its length (pipeline/delayed_run_patches.py). Besides these, `_train` registers forward hooks on
an MoE model's TopKRouter modules (observability/moe_routing.py: tokens per expert, for
--metrics-json).
"""

from __future__ import annotations

import functools
import importlib

import torch

from megatron_async import patch_table
from megatron_async.megatron_lm.adapter import flags, megatron_asserts, plugin_run, run_mode, runtime, setup_checks
from megatron_async.patch_table import Patch as Hook
from megatron_async.patch_table import Scope
from megatron_async.pipeline.non_finite import check_train_step, megatron_check_as_ours

EVERY, DELAYED, CPU = Scope.EVERY_RUN, Scope.DELAYED, Scope.CPU
_INSTALLED: list = []  # what install() replaced (patch_table.install), for uninstall()


class MissingHookError(RuntimeError):
    """This Megatron version lacks a name the plugin hooks."""


def _add_megatron_arguments(original):
    @functools.wraps(original)
    def hooked(parser):
        parser = flags.add_arguments(original(parser))
        megatron_asserts.remember_flags(parser)  # Megatron's messages name arguments; ours name their flags
        return parser

    return hooked


def _validate_args(original):
    """Megatron's failed checks as our one line naming the user's flag (megatron_asserts.py),
    those it makes only while setting training up included (setup_checks.py), and its
    argument dump printed only once our checks pass, so a refusal comes last."""

    @functools.wraps(original)
    def hooked(args, *rest, **kwargs):
        flags.validate_first(args)  # what Megatron would only assert, without a word
        held = []
        setattr(args, HELD_DUMPS_ATTR, held)
        try:
            with megatron_asserts.as_flag_errors(args):
                result = original(args, *rest, **kwargs)
            megatron_asserts.check_train_batch(args)
            flags.validate(args)
            setup_checks.check_setup(args)
        finally:
            delattr(args, HELD_DUMPS_ATTR)
        for dump in held:
            dump()
        return result

    return hooked


# on Megatron's args while its validate_args runs: its argument dumps, printed once our checks pass
HELD_DUMPS_ATTR = "megatron_async_held_dumps"


def _print_args(original):
    """Megatron prints every argument (some 870 lines) at the end of validate_args, before
    our checks run: held back by _validate_args until they pass."""

    @functools.wraps(original)
    def hooked(title, args):
        held = getattr(args, HELD_DUMPS_ATTR, None)
        if held is None:
            return original(title, args)
        held.append(functools.partial(original, title, args))
        return None

    return hooked


def _get_forward_backward_func(original):
    @functools.wraps(original)
    def hooked(*args, **kwargs):
        from megatron.training import get_args

        delayed = plugin_run.delayed()
        func = original(*args, **kwargs)
        func = delayed.forward_backward_func(func) if delayed is not None else func
        return megatron_check_as_ours(func, lambda: get_args().curr_iteration + 1, runtime.pipeline_stage)

    return hooked


def _get_megatron_optimizer(original):
    @functools.wraps(original)
    def hooked(config, model_chunks, *args, **kwargs):
        from megatron.training import get_args

        margs = get_args()
        if margs.layout_invariant_init:
            from megatron_async.megatron_lm.adapter.layout_invariant_init import init_by_global_name, megatron_like

            init_by_global_name(model_chunks, margs.seed, megatron_like(margs.init_method_std, margs.num_layers))
        mode = run_mode.of(margs)
        if mode.simulated and mode.simulated_stages > 1:
            from megatron_async.pipeline.grad_stats import clip_like_pipeline_stages

            clip_like_pipeline_stages(model_chunks, margs.num_layers, mode.simulated_stages)
        if margs.save:  # before any checkpoint is loaded or saved (megatron_lm/safety/save_lock.py)
            from megatron_async.megatron_lm.safety.save_lock import take_on_every_rank

            from megatron_async.megatron_lm.safety.save_space import check_room

            take_on_every_rank(margs.save)
            check_room(margs.save, model_chunks, margs)
        # the delayed run built whole around Megatron's optimizer (None: a synchronous run)
        delayed = plugin_run.build_delayed_run(margs, model_chunks,
                                               lambda: original(config, model_chunks, *args, **kwargs))
        plugin_run.start(margs, delayed)
        if delayed is None:
            return original(config, model_chunks, *args, **kwargs)
        return delayed.megatron_optimizer

    return hooked


def _train_step(original):
    """Synchronous schedules stop at a non-finite loss or gradient norm too (delayed runs
    check inside their optimizer), before the iteration can be checkpointed."""

    @functools.wraps(original)
    def hooked(forward_step_func, data_iterator, model, optimizer, *args, **kwargs):
        result = original(forward_step_func, data_iterator, model, optimizer, *args, **kwargs)
        if plugin_run.delayed() is None:
            from megatron.training import get_args

            check_train_step(result, optimizer, get_args().curr_iteration + 1, runtime.pipeline_stage())
        return result

    return hooked


def _stage_local_reduction(original):
    """Under 2bw reduce over the stage's tensor-parallel ranks, not TP x PP."""

    @functools.wraps(original)
    def hooked(value, group=None):
        delayed = plugin_run.delayed()
        return original(value, group=delayed.reduction_group(group) if delayed is not None else group)

    return hooked


def _embedding_grads_all_reduce(original):
    """Under 2bw a tied model's embedding gradients travel point to point instead
    (pipeline/tied_embeddings.py): Megatron's all-reduce over the first and last stage
    would be a blocking collective spanning stages every step."""

    @functools.wraps(original)
    def hooked(*args, **kwargs):
        delayed = plugin_run.delayed()
        return (delayed.embedding_grads_all_reduce(original) if delayed is not None else original)(*args, **kwargs)

    return hooked


def _train(original):
    @functools.wraps(original)
    def hooked(*args, **kwargs):
        from megatron.training import get_args

        run = plugin_run.current()
        barrier_group = run.delayed.interval_barrier_group() if run is not None and run.delayed is not None else None
        if barrier_group is not None:
            from megatron.training import get_timers

            # the interval timer's barrier (every --log-interval) over this stage only
            get_timers()("interval-time", log_level=0).set_barrier_group(barrier_group)
        if get_args().num_experts and get_args().metrics_json:  # forward hooks on its TopKRouters
            run.routing.attach(kwargs["model"] if "model" in kwargs else args[1])
        delayed = run.delayed if run is not None else None
        if run is not None:
            run.metrics.start_clock()  # the first iteration's s_per_iter counts from here
        try:
            result = original(*args, **kwargs)
        except SystemExit:  # Megatron's exits inside train (--exit-interval, ...): drain and finish first
            if delayed is not None:
                delayed.finish()
            raise
        except BaseException:
            if delayed is not None:
                delayed.abandon()
            raise
        if delayed is not None:
            delayed.finish()
        return result

    return hooked


def _training_log(original):
    @functools.wraps(original)
    def hooked(*args, **kwargs):
        run = plugin_run.current()
        if run is None:
            return original(*args, **kwargs)
        pending = run.delayed.pending_sends() if run.delayed is not None else None
        run.metrics.record_iteration(original, args, kwargs, pending)
        result = original(*args, **kwargs)
        run.metrics.record_routing(run.routing, args, kwargs)  # after Megatron's MoE report, which it reads
        return result

    return hooked


def _moe_aggregate(original):
    """The per-layer aux loss as Megatron averages it, for the routing record."""

    @functools.wraps(original)
    def hooked(self, loss_scale, num_moe_layers, metric_names, *args, **kwargs):
        run = plugin_run.current()
        if run is not None:
            run.routing.capture_aux(self, loss_scale, metric_names)
        return original(self, loss_scale, num_moe_layers, metric_names, *args, **kwargs)

    return hooked


def _save_checkpoint(original):
    """Every run: the --save lock still names this job, and a disk that fills is one line of
    ours. A delayed run's save is one DelayedSave (checkpoint/delayed_save.py), held on the
    run while Megatron's save runs, for the hooks Megatron calls inside it."""

    @functools.wraps(original)
    def hooked(iteration, *args, **kwargs):
        from megatron.training import get_args

        from megatron_async.megatron_lm.checkpoint.delayed_save import DelayedSave
        from megatron_async.megatron_lm.safety.save_lock import check_before_save

        root = get_args().save
        check_before_save(root, iteration)  # one writer per --save
        delayed = plugin_run.delayed()
        if delayed is None:
            return original(iteration, *args, **kwargs)
        save = DelayedSave(delayed, root, iteration, persistent=not kwargs.get("non_persistent_ckpt", False))
        save.before_megatron_writes()
        with delayed.saving(save):
            result = original(iteration, *args, **kwargs)
        save.after_megatron_returned()
        return result

    from megatron_async.megatron_lm.safety.full_disk import named_when_the_disk_fills

    return named_when_the_disk_fills(hooked)  # a disk that fills during the save: one line of ours


def _saving():
    """The delayed run's save under way (checkpoint/delayed_save.py), None outside one."""
    delayed = plugin_run.delayed()
    return delayed.save_under_way() if delayed is not None else None


def _dist_checkpointing_save(original):
    """torch_dist: once Megatron's synchronous save returned on every rank, the save's
    checksums (DelayedSave.after_every_rank_wrote)."""

    @functools.wraps(original)
    def hooked(sharded_state_dict, checkpoint_dir, *args, **kwargs):
        result = original(sharded_state_dict, checkpoint_dir, *args, **kwargs)
        save = _saving()
        if save is not None and result is None:  # an asynchronous save is still writing
            from megatron.training import get_args

            save.after_every_rank_wrote(checkpoint_dir, with_checksums=not get_args().no_checkpoint_checksums)
        return result

    return hooked


def _checkpoint_tracker_filename(original):
    """Rank 0 names the tracker file once every rank has saved, right before writing it:
    the save's torch_dist marker is written there (DelayedSave.at_the_tracker), so no
    tracker ever names a 2bw checkpoint without it."""

    @functools.wraps(original)
    def hooked(checkpoints_path):
        save = _saving()
        if save is not None:
            save.at_the_tracker()
        return original(checkpoints_path)

    return hooked


def _load_checkpoint(original):
    """A checkpoint that fails to load is named, with the previous complete one.

    Megatron's loader gives up with a bare `sys.exit()` (exit code 0) on an unreadable
    file, a bad tracker, a missing rng state, `--exit-on-missing-checkpoint`: each
    becomes an error here, so a job that trained nothing never exits 0."""

    @functools.wraps(original)
    def hooked(*args, **kwargs):
        if kwargs.get("load_arg", args[3] if len(args) > 3 else "load") == "load":
            from megatron.training import get_args

            from megatron_async.megatron_lm.safety.checksum_guard import verify_before_load

            verify_before_load(get_args())  # files changed since the save: refused before Megatron reads them
        try:
            return original(*args, **kwargs)
        except BaseException as err:  # torch.distributed.checkpoint's CheckpointException is one
            if isinstance(err, (KeyboardInterrupt, GeneratorExit)):
                raise
            from megatron.training import get_args

            from megatron_async.megatron_lm.safety.checkpoint_guard import load_failure, tracked_iteration
            from megatron_async.megatron_lm.checkpoint.side_files import CheckpointStateError

            margs = get_args()
            if isinstance(err, SystemExit) and err.code not in (None, 0):
                raise
            if isinstance(err, SystemExit) and getattr(margs, "exit_on_missing_checkpoint", False) and (
                    not margs.load or tracked_iteration(margs.load) is None):
                raise CheckpointStateError(
                    f"megatron-async: --exit-on-missing-checkpoint: --load {margs.load} holds no checkpoint to "
                    "resume, so nothing was trained") from None
            if isinstance(err, CheckpointStateError):
                raise
            root = margs.load if tracked_iteration(margs.load or "") is not None else (
                getattr(margs, "pretrained_checkpoint", None) or margs.load)
            step = getattr(margs, "ckpt_step", None)
            iteration = step if step is not None else tracked_iteration(root) if root else None
            if iteration is None:
                if isinstance(err, SystemExit):
                    raise CheckpointStateError(
                        "megatron-async: Megatron's checkpoint loader gave up (its message is above) with exit "
                        "code 0; nothing was trained") from None
                raise
            raise CheckpointStateError(f"megatron-async: {load_failure(root, iteration, err)}") from err

    return hooked


def _checkpoint_and_decide_exit(original):
    """Under 2bw, --exit-signal-handler and --exit-duration-in-mins stop every rank at one
    iteration agreed through pipeline/stop_agreement.py, not Megatron's blocking gather
    over all ranks each iteration (its checks answer no under the agreement:
    _signals_received, StopAgreement.take_over); Megatron's own saves and --exit-interval
    are unchanged."""

    @functools.wraps(original)
    def hooked(model, optimizer, opt_param_scheduler, iteration, num_floating_point_operations_so_far,
               checkpointing_context, train_data_iterator):
        from megatron.training import get_args

        margs = get_args()
        delayed = plugin_run.delayed(margs)
        if original(model, optimizer, opt_param_scheduler, iteration, num_floating_point_operations_so_far,
                    checkpointing_context, train_data_iterator):
            return True  # DelayedRun.finish settles the agreement
        code, posted = delayed.agreed_stop(iteration) if delayed is not None else (0, None)
        if not code:
            return False
        from megatron.training import training
        from megatron_async.pipeline.stop_agreement import REASONS

        if margs.save and not (margs.save_interval and iteration % margs.save_interval == 0):
            training.save_checkpoint_and_time(iteration, model, optimizer, opt_param_scheduler,
                                              num_floating_point_operations_so_far, checkpointing_context,
                                              train_data_iterator=train_data_iterator)
        if torch.distributed.get_rank() == 0:
            print(f"megatron-async: stopping after iteration {iteration}, agreed by every rank: {REASONS[code]} "
                  f"(seen after iteration {posted})", flush=True)
            runtime.note_early_stop(iteration, REASONS[code], bool(margs.save))
        return True

    return hooked


def _signals_received(original):
    """Megatron's signal check, an all-gather over every rank each iteration: under a stop
    agreement it answers that no rank got a signal, and the agreement decides."""

    @functools.wraps(original)
    def hooked(self):
        delayed = plugin_run.delayed()
        if delayed is not None and delayed.takes_over_signals():
            return [False]
        return original(self)

    return hooked


def _check_scheduler_value(original):
    """Megatron asserts when a schedule flag (--train-iters, --lr, ...) differs from the
    checkpoint's; say which flags choose between the two."""

    @functools.wraps(original)
    def hooked(self, cls_value, sd_value, name):
        try:
            return original(self, cls_value, sd_value, name)
        except AssertionError:
            from megatron.training import get_args

            from megatron_async.megatron_lm.checkpoint.side_files import CheckpointStateError

            this, saved = cls_value, sd_value
            margs = get_args()
            # Megatron counts these in samples (iterations x global batch) when --train-iters is given
            if "iterations" in name and margs.train_samples is None and margs.rampup_batch_size is None:
                gbs = margs.global_batch_size
                if isinstance(this, int) and isinstance(saved, int) and this % gbs == 0 and saved % gbs == 0:
                    this, saved = this // gbs, saved // gbs
            raise CheckpointStateError(
                f"megatron-async: the learning-rate schedule's {name} is {this} in this run but {saved} in "
                "the checkpoint (a changed --train-iters, --lr, warm-up or decay flag); pass "
                "--override-opt_param-scheduler to use this run's values, or --use-checkpoint-opt_param-scheduler "
                "to keep the checkpoint's") from None

    return hooked


def _get_rng_state(original):
    @functools.wraps(original)
    def hooked(*args, **kwargs):
        from megatron_async.megatron_lm.checkpoint import saved_rng

        delayed = plugin_run.delayed()
        snapshot = delayed.rng_for_save() if delayed is not None else None
        if snapshot is None:
            return original(*args, **kwargs)
        current = saved_rng.capture_rng()
        saved_rng.restore_rng(snapshot)
        try:
            return original(*args, **kwargs)
        finally:
            saved_rng.restore_rng(current)

    return hooked


def _evaluate_and_print_results(original):
    @functools.wraps(original)
    def hooked(prefix, forward_step_func, data_iterator, model, iteration, *args, **kwargs):
        run = plugin_run.current()
        if run is not None:
            run.metrics.evaluation_context(prefix, iteration)
        return original(prefix, forward_step_func, data_iterator, model, iteration, *args, **kwargs)

    return hooked


def _evaluate(original):
    @functools.wraps(original)
    def hooked(*args, **kwargs):
        result = original(*args, **kwargs)
        run = plugin_run.current()
        if run is not None:
            run.metrics.record_evaluation(result[0])
        return result

    return hooked


def _on_cpu(adjust):
    """A hook that runs `adjust(original, *args, **kwargs)` where the CPU emulation is
    active and leaves the call alone elsewhere (on GPUs nothing changes)."""

    def wrap(original):
        @functools.wraps(original)
        def hooked(*args, **kwargs):
            from megatron_async import cpu

            if cpu.is_active():
                return adjust(original, *args, **kwargs)
            return original(*args, **kwargs)

        return hooked

    return wrap


def _keep_cpu_rng(original, *args, **kwargs):
    """On CPU, dropout draws from the CPU generator, and so does every DataLoader
    iterator Megatron builds after restoring a checkpoint's RNG: the draws are
    undone, so a resumed run drops out exactly as the uninterrupted one (on GPU
    dropout uses the CUDA generator, which the loaders do not touch)."""
    state = torch.get_rng_state()
    try:
        return original(*args, **kwargs)
    finally:
        torch.set_rng_state(state)


_build_data_iterators = _on_cpu(_keep_cpu_rng)
_initialize_megatron = _on_cpu(lambda original, *args, **kwargs: original(*args, **{**kwargs, "allow_no_cuda": True}))
_set_jit_fusion_options = _on_cpu(lambda original, *args, **kwargs: None)  # its warm-up compiles CUDA kernels


def _compile_helpers(original):
    @functools.wraps(original)
    def hooked():
        try:  # the megatron-core wheel ships the built helpers but not their Makefile
            importlib.import_module("megatron.core.datasets.helpers_cpp")
        except ImportError:
            return original()
        return None

    return hooked


def _moe_metrics_sync(original):
    """Under 2bw, the MoE metrics (aux loss, ...) of this stage's layers only: Megatron
    sums them over the pipeline group every logged iteration, a collective across
    stages. Its own argument for the groups (`pg_collection`) gets this rank alone as the
    pipeline group (made before training, two_bw_run.TwoBWRun.build); the
    reductions inside the stage (tensor, expert, data parallel) stay."""

    @functools.wraps(original)
    def hooked(self, metric_names, pg_collection=None):
        delayed = plugin_run.delayed()
        groups = delayed.moe_metrics_groups(pg_collection) if delayed is not None else pg_collection
        return original(self, metric_names, groups)

    return hooked


def _transformer_config(original):
    from megatron_async.megatron_lm.adapter.combined_step_flags import transformer_config

    return transformer_config(original)


T = "megatron.training.training"
A = "megatron.training.arguments"
HOOKS = (
    Hook(A, "add_megatron_arguments", "arguments.py:121 parse_args: every parser, --help", _add_megatron_arguments,
         EVERY),
    Hook(A, "validate_args", "arguments.py:107 parse_and_validate_args", _validate_args, EVERY),
    Hook(A, "_print_args", "arguments.py:1904 validate_args: the argument dump", _print_args, EVERY),
    Hook("megatron.training.argument_utils", "core_transformer_config_from_args",
         "argument_utils.py:451 gpt_config_from_args, Megatron-LM's model providers (arguments.py re-exports it); "
         "--overlap-moe-expert-parallel-comm under 2bw: no demand for virtual stages",
         _transformer_config, DELAYED, also=(A,)),
    Hook(T, "get_forward_backward_func", "training.py:3614 train, 4198 evaluate", _get_forward_backward_func, EVERY),
    Hook(T, "get_megatron_optimizer", "training.py:2132 setup_model_and_optimizer (before load_checkpoint, 2199)",
         _get_megatron_optimizer, EVERY),
    Hook(T, "save_checkpoint", "training.py:3086 save_checkpoint_and_time (every save in train), 2181, 2273",
         _save_checkpoint, EVERY),
    Hook("megatron.training.checkpointing", "get_rng_state", "checkpointing.py:645 save_checkpoint",
         _get_rng_state, DELAYED),
    Hook("megatron.core.dist_checkpointing", "save",
         "checkpointing.py:827 save_checkpoint (torch_dist; before every rank's barrier and rank 0's tracker)",
         _dist_checkpointing_save, DELAYED),
    Hook("megatron.training.checkpointing", "get_checkpoint_tracker_filename",
         "checkpointing.py:960 save_checkpoint (rank 0, after every rank saved, before the tracker is written)",
         _checkpoint_tracker_filename, DELAYED),
    Hook(T, "load_checkpoint", "training.py:2199 setup_model_and_optimizer", _load_checkpoint, EVERY),
    Hook("megatron.core.optimizer_param_scheduler:OptimizerParamScheduler", "_check_and_set",
         "optimizer_param_scheduler.py:318, from load_state_dict when a checkpoint is loaded", _check_scheduler_value,
         EVERY),
    Hook(T, "logical_and_across_model_parallel_group", "training.py:2503 train_step: update_successful",
         _stage_local_reduction, DELAYED),
    Hook(T, "reduce_max_stat_across_model_parallel_group",
         "training.py:2506/2508 train_step: grad norm, zeros; 2675 training_log: learning rate", _stage_local_reduction,
         DELAYED),
    Hook("megatron.core.distributed.finalize_model_grads", "_allreduce_word_embedding_grads",
         "finalize_model_grads.py:659 finalize_model_grads (tied embeddings, MTP)", _embedding_grads_all_reduce,
         DELAYED),
    Hook(T, "train", "training.py:1423 pretrain", _train, EVERY),
    Hook(T, "train_step", "training.py:3856 train", _train_step, EVERY),
    Hook(T, "checkpoint_and_decide_exit", "training.py:4079 train", _checkpoint_and_decide_exit, DELAYED),
    Hook("megatron.training.dist_signal_handler:DistributedSignalHandler", "signals_received",
         "training.py:3249 checkpoint_and_decide_exit (--exit-signal-handler)", _signals_received, DELAYED),
    Hook(T, "training_log", "training.py:3985 train", _training_log, EVERY),
    Hook(T, "evaluate_and_print_results", "training.py:4040 train, 1483/1494 pretrain", _evaluate_and_print_results,
         EVERY),
    Hook(T, "evaluate", "training.py:4402 evaluate_and_print_results", _evaluate, EVERY),
    Hook(T, "build_train_valid_test_data_iterators", "training.py:1362 pretrain (CPU only: RNG kept)",
         _build_data_iterators, CPU),
    Hook(T, "initialize_megatron", "training.py:1091 pretrain (allow_no_cuda on CPU only)", _initialize_megatron, CPU),
    Hook("megatron.core.datasets.utils", "compile_helpers", "initialize.py:178 _compile_dependencies",
         _compile_helpers, EVERY),
    Hook(T, "set_jit_fusion_options", "training.py:1117 pretrain (skipped on CPU only)", _set_jit_fusion_options, CPU),
    Hook("megatron.core.transformer.moe.moe_logging:MoEMetricsTracker", "_sync_metrics",
         "moe_logging.py:188 MoEMetricsTracker.report, from training.py:2782 training_log", _moe_metrics_sync, DELAYED),
    Hook("megatron.core.transformer.moe.moe_logging:MoEMetricsTracker", "_aggregate",
         "moe_logging.py:191 MoEMetricsTracker.report, from training.py:2782 training_log", _moe_aggregate, EVERY),
)


PROCESS = (  # not Megatron's: the process the hooks run in
    Hook("sys", "excepthook", "an uncaught refusal of ours: its one line and exit code where no launcher of ours "
         "catches it (megatron_lm/safety/failures.py)", lambda previous: _excepthook_over(previous), EVERY),
)


def _excepthook_over(previous):
    from megatron_async.megatron_lm.safety.failures import excepthook_over

    return excepthook_over(previous)


def install() -> None:
    """Hook Megatron's training loop (idempotent). Raises MissingHookError naming
    the first hooked name this Megatron version lacks, before changing anything."""
    if _INSTALLED:
        return
    try:
        patch_table.check(HOOKS)
    except patch_table.MissingTargetError as err:
        hook = err.patch
        if str(err).startswith("cannot import"):
            raise MissingHookError(f"megatron-async: {err}") from None
        from megatron.core import __version__

        raise MissingHookError(
            f"megatron-async: {hook.module}.{hook.name} (called at {hook.called_at} in megatron-core 0.19.2) "
            f"does not exist in megatron-core {__version__}") from None
    if _INSTALLED:  # importing a patched megatron.training above installed them already
        return
    patch_table.install(HOOKS + PROCESS, _INSTALLED)
    from megatron_async.megatron_lm.safety.launcher_watch import exit_with_launcher

    exit_with_launcher()  # every entry installs the hooks: launch, the console scripts, a patched script


def uninstall() -> None:
    """Megatron's functions (and the excepthook) back as they were before install()."""
    patch_table.restore(_INSTALLED)

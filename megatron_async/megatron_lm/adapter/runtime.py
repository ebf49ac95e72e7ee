"""2bw and the simulated delay inside Megatron's training loop.

Megatron's train_step calls a forward-backward function once per iteration and
then steps the optimizer. Under `--pipeline-schedule 2bw` that function is
`DelayedRun.forward_backward`: it drives one persistent TwoBWRunner per run,
which runs this stage's action list up to its optimizer step t, finalises the
gradients (Megatron's finalize_model_grads) and returns the batch's loss reports,
leaving the next batch's warm-up forwards in flight. The optimizer Megatron steps
is a DelayedStepOptimizer: it saves the live weights into the stash before the
step, checks this stage's gradient norm, and keeps the one-step delay.
`--simulated-delay K` wraps Megatron's own schedule instead, running it at the
weights of K steps ago: the reference 2bw must equal.
"""

from __future__ import annotations

import itertools
from functools import partial

import torch
from megatron.core import parallel_state

from megatron_async.corrections.delay_correction import RULES
from megatron_async.megatron_lm.checkpoint import optimizer_state
from megatron_async.megatron_lm.checkpoint.optimizer_state import STALE_NORM_KEY, STASH_KEY
from megatron_async.megatron_lm.checkpoint.saved_rng import RngSnapshots
from megatron_async.pipeline.delayed_step import delayed_optimizer_step
from megatron_async.schedules.registry import delayed_runtime

ABANDON_WAIT_S = 30.0


class DelayedStepOptimizer:
    """A Megatron optimizer whose step keeps the weight stash in order: the live
    weights are saved before the step, which then updates them in place.

    Its sharded state dict adds the stash and the stale global norm to the wrapped
    optimizer's, and its load takes them out again (megatron_lm/checkpoint/optimizer_state.py).
    Everything else is the wrapped optimizer's (loss scale, groups).
    """

    def __init__(self, optimizer, run: "DelayedRun", load_stash: bool = True, load_stale_norm: bool = False):
        self.optimizer = optimizer
        self.run = run
        self.stash = run.stash
        self.load_stash = load_stash  # False: the checkpoint to resume has no stash
        self.load_stale_norm = load_stale_norm

    def __getattr__(self, name):
        return getattr(self.optimizer, name)

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, **kwargs):
        """The wrapped optimizer's, with the stash and the stale global norm
        (megatron_lm/checkpoint/optimizer_state.py)."""
        return optimizer_state.sharded_state_dict(self, model_sharded_state_dict, is_loading, **kwargs)

    def load_state_dict(self, state_dict) -> None:
        optimizer_state.load_state_dict(self, state_dict)

    def step(self):
        from megatron.training import get_args

        return delayed_optimizer_step(self.optimizer, self.stash, self.run.stale_norm, self.run.runner,
                                      get_args().curr_iteration + 1, parallel_state.get_pipeline_model_parallel_rank())


class DelayedRun:
    """One delayed-weight run (2bw, or --simulated-delay) in Megatron's loop: its weight
    stash, the 2bw runner, the step it is at, the stale global norm, the stop agreement and
    what the checkpoint it resumed from holds. Made in the optimizer hook
    (megatron_lm/adapter/plugin_run.py), reached by the hooks through `plugin_run.current()`;
    nothing of it lives in a module."""

    def __init__(self):
        self.stash = None
        self.runner = None
        self.step = None
        self.data_iterator = None
        self.version_for = None
        self.stale_norm = None
        self.optimizer = None
        self.resumed: dict = {}
        self.stop = None
        self.saving = None  # the save under way, while Megatron's save_checkpoint runs (checkpoint/delayed_save.py)
        self.rank_only_group = None  # under 2bw with MoE: the "pipeline group" of Megatron's MoE metrics
        self.rng = RngSnapshots()  # the RNG state a checkpoint saves (checkpoint/saved_rng.py)

    def wrap_optimizer(self, model, optimizer):
        """Right after Megatron builds the optimizer, before it loads a checkpoint:
        stage-local gradient statistics, the weight stash, EF and the delayed step.
        Returns the optimizer Megatron's loop is to use."""
        from megatron.training import get_args

        from megatron_async.megatron_lm.checkpoint.marker import saved_contents
        from megatron_async.pipeline.grad_stats import make_stage_local
        from megatron_async.stash.weight_stash import WeightStashManager

        args = get_args()
        two_bw = delayed_runtime(args.pipeline_schedule)
        if two_bw:
            make_stage_local(optimizer, args.use_distributed_optimizer)
        resumed = self.resumed = saved_contents(args) if args.load else {}
        in_optimizer = resumed.get("per_rank_state", "optimizer") == "optimizer"  # else in per-rank files
        if args.delay_correction in RULES:
            from megatron_async.corrections.delay_correction import DelayCorrectedOptimizer
            from megatron_async.megatron_lm.adapter.flags import nesterov_beta

            optimizer = DelayCorrectedOptimizer(optimizer, ef_lambda=args.ef_lambda, rule=args.delay_correction,
                                                dc_lambda=args.dc_lambda, nesterov_beta=nesterov_beta(args),
                                                checkpoint=optimizer_state)
            optimizer.delay_correction.load_expected = bool(resumed.get("delay_correction")) and in_optimizer
        if two_bw and args.clip_grad_mode == "stale-global":
            from megatron_async.pipeline.p2p import duplicate_pipeline_group
            from megatron_async.pipeline.stale_global import StaleGlobalNorm

            self.stale_norm = StaleGlobalNorm(duplicate_pipeline_group(backend="gloo"))
        # A checkpoint without a stash (e.g. from a 1F1B run) starts both versions equal.
        predict = args.prediction_alpha if args.delay_correction == "predict" else None
        self.stash = WeightStashManager(model, depth=max(args.simulated_delay, 1), predict=predict)
        self.optimizer = optimizer
        return DelayedStepOptimizer(optimizer, self, load_stash=bool(resumed.get(STASH_KEY)) and in_optimizer,
                                    load_stale_norm=bool(resumed.get(STALE_NORM_KEY)) and in_optimizer)

    def start_stop_agreement(self, args) -> None:
        """Under 2bw with --exit-signal-handler or --exit-duration-in-mins: the group every
        rank agrees on its stop iteration over (pipeline/stop_agreement.py), made before
        training, where every rank is."""
        if not delayed_runtime(args.pipeline_schedule) or not (args.exit_signal_handler or args.exit_duration_in_mins):
            return
        from megatron_async.pipeline.stop_agreement import StopAgreement

        # a host group: its codes are CPU scalars, so it adds no GPU kernel and no device sync to an
        # iteration, and Megatron's whole-device waits at step ends do not wait for the slowest stage
        group = torch.distributed.new_group(list(range(torch.distributed.get_world_size())), backend="gloo")
        self.stop = StopAgreement(group, torch.device("cpu"))
        self.stop.take_over(args)

    def start_moe_metrics_group(self, args) -> None:
        """Under 2bw with MoE layers: a group of this rank alone, which Megatron's MoE metrics
        sync is given as its pipeline group, so its metrics stay inside the stage. Made here,
        before training, where every rank is (every rank takes part in making each group)."""
        if not delayed_runtime(args.pipeline_schedule) or not args.num_experts:
            return
        self.rank_only_group, _ = torch.distributed.new_subgroups(group_size=1)

    def start_from_checkpoint(self, args) -> None:
        """Before the first step the stash holds the weights training starts from.

        A stash restored from the checkpoint is at --load's iteration. Otherwise (a fresh
        start, a 1F1B checkpoint, --no-load-optim, --finetune, --pretrained-checkpoint)
        every stashed version becomes a copy of the live weights as loaded: the stash was
        filled when the optimizer was built, before Megatron loaded any checkpoint. One the
        checkpoint promises but did not give back is an error, never a silent start."""
        stash = self.stash
        if stash.restored and stash.newest == args.iteration:
            return
        if self.resumed.get(STASH_KEY) and not (args.no_load_optim or args.finetune):
            from megatron_async.megatron_lm.checkpoint.side_files import CheckpointStateError

            raise CheckpointStateError(
                f"megatron-async: the checkpoint in {self.resumed.get('loaded_from')} says it holds the 2bw weight "
                f"stash, but it was not restored (stash at step {stash.newest}, run at iteration {args.iteration}). "
                "A checkpoint saved with --ckpt-format torch by an older megatron-async lacks it: delete its "
                "megatron_async.json to resume with both weight versions equal")
        loaded = not stash.holds_live()  # a checkpoint load changed the weights after the stash copied them
        stash.start_equal_at(args.iteration)
        if (loaded or self.resumed.get(STASH_KEY)) and torch.distributed.get_rank() == 0:
            if args.finetune:  # Megatron sets it for --pretrained-checkpoint too
                why = "--finetune: the checkpoint's weights are loaded without a weight stash"
            elif args.no_load_optim and self.resumed.get(STASH_KEY):
                why = "--no-load-optim: the checkpoint's weight stash is not loaded"
            else:
                why = "the checkpoint holds no weight stash"
            print(f"megatron-async: {why}; both weight versions start equal, at the loaded weights "
                  f"(iteration {args.iteration})", flush=True)

    def _runner(self, model_chunk, forward_step_func):
        from megatron.core.num_microbatches_calculator import get_num_microbatches
        from megatron.core.utils import get_model_config
        from megatron.training import get_args

        from megatron_async.schedules.registry import get_runtime

        if self.runner is None:
            args = get_args()
            config = get_model_config(model_chunk)
            self.start_from_checkpoint(args)
            self.step = args.iteration
            self.runner = get_runtime(args.pipeline_schedule)(
                [model_chunk], None, get_num_microbatches(), args.train_iters,
                activation_shape=_activation_shape(args, config),
                dtype=config.pipeline_dtype or args.params_dtype,
                forward_step_func=forward_step_func,
                data_for=lambda _k: self.data_iterator,
                start_batch=args.iteration,
                stash=self.stash,
                finalize_grads=partial(config.finalize_model_grads_func, [model_chunk], None),
                clip_grad_mode=args.clip_grad_mode,
                stale_norm=self.stale_norm,
                on_batch_start=self.rng.snapshot,
            )
        return self.runner

    def forward_backward(self, *, forward_step_func, data_iterator, model, num_microbatches, forward_only=False,
                         **_unused):
        """Megatron's forward-backward signature, for the registry's delayed runtime (2bw)."""
        runner = self._runner(_single(model), forward_step_func)
        data_iterator = _single(data_iterator)
        if forward_only:  # evaluation, on its own process group at the newest weights
            return runner.evaluate_iterators(itertools.repeat(data_iterator, num_microbatches))
        self.data_iterator = data_iterator
        reports, _ = runner.train_step(self.step)
        self.step += 1
        return reports

    def simulated_delay(self, forward_backward):
        """Megatron's schedule run at the weights of the configured delay (PP=1)."""
        from megatron.training import get_args

        def run(*, model, forward_only=False, **kwargs):
            stash = self.stash
            if forward_only:
                stash.point_to(stash.newest)
                return forward_backward(model=model, forward_only=True, **kwargs)
            if self.version_for is None:
                from megatron_async.stash.delay_reference import version_for_step

                args = get_args()
                chunks = model if isinstance(model, list) else [model]
                delays = args.simulated_stage_delays or (args.simulated_delay,)
                self.version_for = version_for_step(chunks, stash, delays, args.num_layers)
                self.step = args.iteration
                self.start_from_checkpoint(args)
            # Megatron's schedule runs the whole batch between two steps: no saved-tensor hooks needed
            with stash.use(self.version_for(self.step), hooks=False):
                out = forward_backward(model=model, **kwargs)
            self.step += 1
            return out

        return run

    def drain(self) -> None:
        """Before a checkpoint save: no point-to-point send stays unmatched over it."""
        if self.runner is not None:
            self.runner.drain()

    def finish(self) -> None:
        """Run the trailing actions of the 2bw pipeline so no neighbour waits on us (at the
        end of --train-iters, and at every exit Megatron takes out of train: --exit-interval
        with or without --save, its other sys.exit paths), and wait out the stop agreement's
        codes still posted (every rank stops after the same iteration, so all posted the same)."""
        if self.runner is not None:
            self.runner.finish()
        if self.stop is not None:
            self.stop.settle()

    def abandon(self) -> None:
        """Training raised: this rank's posted sends were received by now unless a neighbour
        is gone; wait for them (at most ABANDON_WAIT_S each), say how many were not, and
        leave the exception to end the job."""
        if self.runner is None:
            return
        lost = self.runner.abandon(ABANDON_WAIT_S)
        if lost:
            print(f"megatron-async: stage {pipeline_stage()}: {lost} point-to-point send(s) to a neighbour stage "
                  "were never received (it stopped too); the job ends without them", flush=True)


def note_early_stop(iteration: int, reason: str, saved: bool) -> None:
    """Rank 0, after an agreed early stop: tell the job script (MEGATRON_ASYNC_STOP_FILE,
    set by examples/slurm/pretrain_2bw.sbatch, which then requeues the job)."""
    import json
    import os

    path = os.environ.get("MEGATRON_ASYNC_STOP_FILE")
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"iteration": iteration, "reason": reason, "saved": saved}, f)


def _activation_shape(args, config) -> tuple:
    """What a stage sends its neighbour, as Megatron's 1F1B computes it (the sequence
    split over context-parallel ranks, and over tensor-parallel ranks with sequence
    parallelism)."""
    from megatron.core.pipeline_parallel.schedules import get_tensor_shapes

    (shape,) = get_tensor_shapes(seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                                 decoder_seq_length=None, config=config,
                                 tp_group=parallel_state.get_tensor_model_parallel_group(),
                                 cp_group=parallel_state.get_context_parallel_group())
    return shape


def _single(x):
    return x[0] if isinstance(x, list) else x


def stage_group():
    """The ranks of this pipeline stage (tensor x data x context parallel)."""
    return parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)


def pipeline_stage() -> int:
    return parallel_state.get_pipeline_model_parallel_rank()


def is_delayed(args) -> bool:
    """Delayed weights: the registry's delayed runtime (2bw) or --simulated-delay."""
    return delayed_runtime(getattr(args, "pipeline_schedule", None)) or bool(getattr(args, "simulated_delay", 0))


def is_two_bw() -> bool:
    """This run trains on the registry's delayed runtime (2bw)."""
    from megatron.training import get_args

    return delayed_runtime(getattr(get_args(), "pipeline_schedule", None))

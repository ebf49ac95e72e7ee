"""2bw and the simulated delay inside Megatron's training loop.

Megatron's train_step calls a forward-backward function once per iteration and
then steps the optimizer. Under `--pipeline-schedule 2bw` that function is
`TwoBWRun.forward_backward`: it drives one persistent TwoBWRunner per run,
which runs this stage's action list up to its optimizer step t, finalises the
gradients (Megatron's finalize_model_grads) and returns the batch's loss reports,
leaving the next batch's warm-up forwards in flight. The optimizer Megatron steps
is a DelayedStepOptimizer: it saves the live weights into the stash before the
step, checks this stage's gradient norm, and keeps the one-step delay.
`--simulated-delay K` (SimulatedDelayRun) wraps Megatron's own schedule instead,
running it at the weights of K steps ago: the reference 2bw must equal.
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
from megatron_async.schedules.registry import schedule_or_default

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


def run_class(args):
    """The class of this run's delayed mode: the one the schedule's spec names (TwoBWRun for
    2bw), SimulatedDelayRun under --simulated-delay, None for a synchronous run."""
    spec = schedule_or_default(args.pipeline_schedule)
    return spec.run_class() or (SimulatedDelayRun if args.simulated_delay else None)


def build_delayed_run(args, model_chunks, make_optimizer):
    """This run's delayed mode, built whole by the optimizer hook around `make_optimizer()`
    (Megatron's), or None for a synchronous run (then that call is the hook's to make)."""
    cls = run_class(args)
    if cls is None:
        return None
    return cls.build(args, schedule_or_default(args.pipeline_schedule), model_chunks, make_optimizer)


class DelayedRun:
    """What both delayed modes hold in Megatron's loop: the weight stash, the optimizer and
    its delayed-step wrap that Megatron's loop steps, and what the checkpoint it resumed from
    holds. Made whole in the optimizer hook (megatron_lm/adapter/plugin_run.py), reached by the
    hooks through `plugin_run.delayed()`; nothing of it lives in a module. The subclasses
    answer the hooks' questions for their mode."""

    runner = None  # the pipeline runner (2bw only)
    stale_norm = None  # the stale global norm (2bw with --clip-grad-mode stale-global)
    stop = None  # the stop agreement (2bw with --exit-signal-handler / --exit-duration-in-mins)
    rank_only_group = None  # the "pipeline group" of Megatron's MoE metrics (2bw with MoE layers)
    embedding_copy_linked = False  # the last stage's word embeddings kept by the tied link (2bw)

    def __init__(self, args, model_chunks, optimizer, depth: int):
        """Right after Megatron builds the optimizer, before it loads a checkpoint: the delay
        correction, the weight stash (`depth` versions behind the live ones) and the delayed step."""
        from megatron_async.megatron_lm.checkpoint.marker import saved_contents
        from megatron_async.stash.weight_stash import WeightStashManager

        resumed = self.resumed = saved_contents(args) if args.load else {}
        in_optimizer = resumed.get("per_rank_state", "optimizer") == "optimizer"  # else in per-rank files
        if args.delay_correction in RULES:
            from megatron_async.corrections.delay_correction import DelayCorrectedOptimizer
            from megatron_async.megatron_lm.adapter.flags import nesterov_beta

            optimizer = DelayCorrectedOptimizer(optimizer, ef_lambda=args.ef_lambda, rule=args.delay_correction,
                                                dc_lambda=args.dc_lambda, nesterov_beta=nesterov_beta(args),
                                                checkpoint=optimizer_state)
            optimizer.delay_correction.load_expected = bool(resumed.get("delay_correction")) and in_optimizer
        self.optimizer = optimizer
        # A checkpoint without a stash (e.g. from a 1F1B run) starts both versions equal.
        predict = args.prediction_alpha if args.delay_correction == "predict" else None
        self.stash = WeightStashManager(model_chunks, depth=depth, predict=predict)
        self.megatron_optimizer = DelayedStepOptimizer(
            optimizer, self, load_stash=bool(resumed.get(STASH_KEY)) and in_optimizer,
            load_stale_norm=bool(resumed.get(STALE_NORM_KEY)) and in_optimizer)
        self.marker_due = None  # a torch_dist marker written when Megatron names its tracker

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

    def forward_backward_func(self, megatron_forward_backward):
        """The function Megatron's loop calls once per iteration, given the one Megatron picked."""
        raise NotImplementedError

    def reduction_group(self, group):
        """The group of Megatron's model-parallel reductions in train_step and training_log."""
        return group

    def embedding_grads_all_reduce(self, original):
        """Megatron's all-reduce of the tied embedding gradients, or what replaces it."""
        return original

    def interval_barrier_group(self):
        """The group of the interval timer's barrier (None: Megatron's own, every rank)."""
        return None

    def drain(self) -> None:
        """Before a checkpoint save: no point-to-point send stays unmatched over it."""

    def finish(self) -> None:
        """At every exit Megatron takes out of train: nothing is left in flight."""

    def abandon(self) -> None:
        """Training raised: nothing of ours is left to wait for."""


class SimulatedDelayRun(DelayedRun):
    """--simulated-delay K: Megatron's own schedule run at the weights of K steps ago (PP=1),
    per would-be stage with --simulated-delay D0,...,DP-1; the reference 2bw must equal."""

    @classmethod
    def build(cls, args, spec, model_chunks, make_optimizer) -> "SimulatedDelayRun":
        return cls(args, model_chunks, make_optimizer())

    def __init__(self, args, model_chunks, optimizer):
        from megatron_async.stash.delay_reference import version_for_step

        super().__init__(args, model_chunks, optimizer, depth=max(args.simulated_delay, 1))
        delays = args.simulated_stage_delays or (args.simulated_delay,)
        self.version_for = version_for_step(model_chunks, self.stash, delays, args.num_layers)
        self.started = False  # the stash starts from the loaded weights at the first step

    def forward_backward_func(self, forward_backward):
        """Megatron's schedule `forward_backward`, run at the delayed weights of each iteration."""
        from megatron.training import get_args

        def run(*, model, forward_only=False, **kwargs):
            stash = self.stash
            if forward_only:
                stash.point_to(stash.newest)
                return forward_backward(model=model, forward_only=True, **kwargs)
            args = get_args()
            if not self.started:  # after Megatron loaded the checkpoint, before the first step
                self.start_from_checkpoint(args)
                self.started = True
            # Megatron's schedule runs the whole batch between two steps: no saved-tensor hooks needed
            with stash.use(self.version_for(args.curr_iteration), hooks=False):
                return forward_backward(model=model, **kwargs)

        return run


class TwoBWRun(DelayedRun):
    """A schedule our pipeline runtime trains (2bw) in Megatron's loop: besides the stash, the
    stage-local gradient statistics, the stale global norm, the stop agreement, the MoE
    metrics group, the RNG state a checkpoint saves, and the spec's runner, started at the
    first forward-backward (the first point where Megatron's loaded iteration and its forward
    step are known). Its stages run up to a step apart: no collective spans them."""

    @classmethod
    def build(cls, args, spec, model_chunks, make_optimizer) -> "TwoBWRun":
        # the run's groups before Megatron's optimizer, where every rank is (every rank takes part)
        stop, rank_only_group = _stop_agreement(args), _rank_only_group(args)
        return cls(args, spec, model_chunks, make_optimizer(), stop, rank_only_group)

    def __init__(self, args, spec, model_chunks, optimizer, stop, rank_only_group):
        from megatron_async.pipeline.grad_stats import make_stage_local

        make_stage_local(optimizer, args.use_distributed_optimizer)
        super().__init__(args, model_chunks, optimizer, depth=spec.stash_copies)
        self.spec = spec
        self.stop = stop
        self.rank_only_group = rank_only_group
        self.stale_norm = _stale_norm(args)
        self.embedding_copy_linked = not args.untie_embeddings_and_output_weights or bool(args.mtp_num_layers)
        self.rng = RngSnapshots()  # the RNG state a checkpoint saves (checkpoint/saved_rng.py)
        self._runner = None  # the spec's runner, started by the first forward-backward

    @property
    def runner(self):
        return self._runner

    @property
    def step(self) -> int:
        """The next optimizer step this stage runs (the one a checkpoint saved now resumes at)."""
        return self._runner.next_step

    def forward_backward_func(self, megatron_forward_backward):
        return self.forward_backward

    def _start(self, model_chunk, forward_step_func):
        from megatron.core.num_microbatches_calculator import get_num_microbatches
        from megatron.core.utils import get_model_config
        from megatron.training import get_args

        from megatron_async.pipeline.stage_context import stage_context

        args = get_args()
        config = get_model_config(model_chunk)
        self.start_from_checkpoint(args)
        context = stage_context(model_chunk, self.stash, forward_step_func, get_num_microbatches(),
                                _activation_shape(args, config), config.pipeline_dtype or args.params_dtype)
        return self.spec.runner_class()(
            context, args.train_iters, start_batch=args.iteration,
            finalize_grads=partial(config.finalize_model_grads_func, [model_chunk], None),
            stale_norm=self.stale_norm, on_batch_start=self.rng.snapshot)

    def forward_backward(self, *, forward_step_func, data_iterator, model, num_microbatches, forward_only=False,
                         **_unused):
        """Megatron's forward-backward signature: one training step of the runner, or an
        evaluation, on its own process group at the newest weights."""
        if self._runner is None:
            self._runner = self._start(_single(model), forward_step_func)
        data_iterator = _single(data_iterator)
        if forward_only:
            return self._runner.evaluate_iterators(itertools.repeat(data_iterator, num_microbatches))
        reports, _ = self._runner.train_step(self._runner.next_step, lambda _k: data_iterator)
        return reports

    def reduction_group(self, group):
        """The stage's tensor-parallel ranks, not TP x PP."""
        return parallel_state.get_tensor_model_parallel_group()

    def embedding_grads_all_reduce(self, original):
        """None: a tied model's embedding gradients travel point to point (pipeline/tied_embeddings.py)."""
        return lambda *args, **kwargs: None

    def interval_barrier_group(self):
        return stage_group()

    def drain(self) -> None:
        if self._runner is not None:
            self._runner.drain()

    def finish(self) -> None:
        """Run the trailing actions of the 2bw pipeline so no neighbour waits on us (at the
        end of --train-iters, and at every exit Megatron takes out of train: --exit-interval
        with or without --save, its other sys.exit paths), and wait out the stop agreement's
        codes still posted (every rank stops after the same iteration, so all posted the same)."""
        if self._runner is not None:
            self._runner.finish()
        if self.stop is not None:
            self.stop.settle()

    def abandon(self) -> None:
        """Training raised: this rank's posted sends were received by now unless a neighbour
        is gone; wait for them (at most ABANDON_WAIT_S each), say how many were not, and
        leave the exception to end the job."""
        if self._runner is None:
            return
        lost = self._runner.abandon(ABANDON_WAIT_S)
        if lost:
            print(f"megatron-async: stage {pipeline_stage()}: {lost} point-to-point send(s) to a neighbour stage "
                  "were never received (it stopped too); the job ends without them", flush=True)


def _stale_norm(args):
    """With --clip-grad-mode stale-global: the stale global norm, over a host group of its own."""
    if args.clip_grad_mode != "stale-global":
        return None
    from megatron_async.pipeline.p2p import duplicate_pipeline_group
    from megatron_async.pipeline.stale_global import StaleGlobalNorm

    return StaleGlobalNorm(duplicate_pipeline_group(backend="gloo"))


def _stop_agreement(args):
    """With --exit-signal-handler or --exit-duration-in-mins: the group every rank agrees on its
    stop iteration over (pipeline/stop_agreement.py)."""
    if not (args.exit_signal_handler or args.exit_duration_in_mins):
        return None
    from megatron_async.pipeline.stop_agreement import StopAgreement

    # a host group: its codes are CPU scalars, so it adds no GPU kernel and no device sync to an
    # iteration, and Megatron's whole-device waits at step ends do not wait for the slowest stage
    group = torch.distributed.new_group(list(range(torch.distributed.get_world_size())), backend="gloo")
    return StopAgreement(group, torch.device("cpu"))


def _rank_only_group(args):
    """With MoE layers: a group of this rank alone, which Megatron's MoE metrics sync is given
    as its pipeline group, so its metrics stay inside the stage."""
    if not args.num_experts:
        return None
    group, _ = torch.distributed.new_subgroups(group_size=1)
    return group


def note_early_stop(iteration: int, reason: str, saved: bool) -> None:
    """Rank 0, after an agreed early stop: tell the job script (MEGATRON_ASYNC_STOP_FILE,
    set by examples/slurm/pretrain_2bw.sbatch, which then requeues the job)."""
    import json
    import os

    path = os.environ.get("MEGATRON_ASYNC_STOP_FILE")
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"iteration": iteration, "reason": reason, "saved": saved}, f)


def local_stop_code(args) -> int:
    """This rank's own reason to stop: a signal Megatron's handler caught here, or its clock."""
    import time

    from megatron.training import training
    from megatron.training.global_vars import get_signal_handler

    from megatron_async.pipeline.stop_agreement import DURATION, GO_ON, SIGNAL

    if args.exit_signal_handler and getattr(get_signal_handler(), "_signal_received", False):
        return SIGNAL
    if args.exit_duration_in_mins and (time.time() - training._TRAIN_START_TIME) / 60.0 > args.exit_duration_in_mins:
        return DURATION
    return GO_ON


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


"""A schedule our pipeline runtime trains (2bw) inside Megatron's training loop: the run
the optimizer hook builds whole, and the forward-backward function Megatron calls once
per iteration (megatron_lm/adapter/runtime.py has what both delayed modes share)."""

from __future__ import annotations

import itertools
from functools import partial

import torch
from megatron_async.megatron_lm.adapter.runtime import DelayedRun, pipeline_stage
from megatron_async.megatron_lm.checkpoint.saved_rng import RngSnapshots

ABANDON_WAIT_S = 30.0


class TwoBWRun(DelayedRun):
    """A schedule our pipeline runtime trains (2bw) in Megatron's loop: besides the stash, the
    stage-local gradient statistics, the stale global norm, the stop agreement, the MoE
    metrics group, the RNG state a checkpoint saves, and the spec's runner, started at the
    first forward-backward (the first point where Megatron's loaded iteration and its forward
    step are known). Its stages run up to a step apart: no collective spans them."""

    @classmethod
    def build(cls, args, mode, model_chunks, make_optimizer) -> "TwoBWRun":
        from megatron.core.process_groups_config import ProcessGroupCollection

        # the run's groups before Megatron's optimizer, where every rank is (every rank takes part);
        # the pipeline code takes Megatron's groups from the run, not from its global state
        groups = ProcessGroupCollection.use_mpu_process_groups()
        stop, rank_only_group = _stop_agreement(args, mode), _rank_only_group(args)
        return cls(args, mode, model_chunks, make_optimizer(), stop, rank_only_group, groups)

    def __init__(self, args, mode, model_chunks, optimizer, stop, rank_only_group, groups):
        from megatron_async.pipeline.grad_stats import make_stage_local

        self.groups = groups
        make_stage_local(optimizer, args.use_distributed_optimizer, groups)
        super().__init__(args, model_chunks, optimizer, depth=mode.stash_depth)
        self.spec = mode.spec
        self.combined_steps = mode.combined_steps  # --overlap-moe-expert-parallel-comm: combined-step lists
        self._stop = stop  # the stop agreement (--exit-signal-handler / --exit-duration-in-mins), or None
        self._rank_only_group = rank_only_group  # the "pipeline group" of Megatron's MoE metrics, or None
        self._stale_norm = _stale_norm(args, groups)  # with --clip-grad-mode stale-global, else None
        self._embedding_copy_linked = not args.untie_embeddings_and_output_weights or bool(args.mtp_num_layers)
        self.rng = RngSnapshots()  # the RNG state a checkpoint saves (checkpoint/saved_rng.py)
        self._runner = None  # the spec's runner, started by the first forward-backward

    def optimizer_step(self, optimizer, iteration: int):
        """The delayed step with the runner's tied link around it and the stale global norm."""
        from megatron_async.pipeline.delayed_step import delayed_optimizer_step

        return delayed_optimizer_step(optimizer, self.stash, self._stale_norm, self._runner, iteration,
                                      pipeline_stage())

    def step_states(self) -> dict:
        from megatron_async.megatron_lm.checkpoint.optimizer_state import STALE_NORM_KEY

        return {STALE_NORM_KEY: self._stale_norm} if self._stale_norm is not None else {}

    def links_embedding_copy(self) -> bool:
        return self._embedding_copy_linked

    @property
    def step(self) -> int:
        """The next optimizer step this stage runs (the one a checkpoint saved now resumes at)."""
        return self._runner.next_step

    def forward_backward_func(self, megatron_forward_backward):
        return self.forward_backward

    def _start(self, model_chunk, forward_step_func):
        from megatron.core.num_microbatches_calculator import get_num_microbatches
        from megatron.core.utils import get_model_config

        from megatron_async.megatron_lm.observability.grad_norm_note import say_grad_norm_note
        from megatron_async.pipeline.stage_context import stage_context

        args = self.args
        if self.combined_steps:  # before any pass: Megatron's combined step needs return_schedule_plan
            from megatron_async.megatron_lm.adapter.combined_step_flags import check_forward_step

            check_forward_step(forward_step_func)
        config = get_model_config(model_chunk)
        self.start_from_checkpoint(args)
        say_grad_norm_note(args)  # before Megatron's first log line, which shows the last stage's norm
        context = stage_context(model_chunk, self.stash, forward_step_func, get_num_microbatches(),
                                _activation_shape(args, config, self.groups), config.pipeline_dtype or args.params_dtype,
                                self.groups, combined_steps=self.combined_steps)
        return self.spec.runner_class()(
            context, partial(self.spec.stream_for, ep_overlap=self.combined_steps), args.train_iters,
            start_batch=args.iteration,
            finalize_grads=partial(config.finalize_model_grads_func, [model_chunk], None),
            stale_norm=self._stale_norm, on_batch_start=self.rng.snapshot)

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
        return self.groups.tp

    def embedding_grads_all_reduce(self, original):
        """None: a tied model's embedding gradients travel point to point (pipeline/tied_embeddings.py)."""
        return lambda *args, **kwargs: None

    def interval_barrier_group(self):
        return self.groups.tp_dp_cp  # the stage's tensor x data x context-parallel ranks

    def agreed_stop(self, iteration: int) -> tuple:
        if self._stop is None:
            return 0, None
        return self._stop.after_iteration(iteration, self._stop.own_code(self.args))

    def takes_over_signals(self) -> bool:
        return self._stop is not None

    def rng_for_save(self):
        return self.rng.for_save(self.step) if self._runner is not None else None

    def moe_metrics_groups(self, pg_collection):
        """With MoE layers: this rank alone as the pipeline group, so the metrics stay inside the stage."""
        if self._rank_only_group is None:
            return pg_collection
        import copy
        from types import SimpleNamespace

        stage_only = copy.copy(pg_collection) if pg_collection is not None else SimpleNamespace()
        stage_only.pp = self._rank_only_group
        return stage_only

    def pending_sends(self):
        return self._runner.pending_sends if self._runner is not None else None

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
        if self._stop is not None:
            self._stop.settle()

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


def _stale_norm(args, groups):
    """With --clip-grad-mode stale-global: the stale global norm, over a host group of its own."""
    if args.clip_grad_mode != "stale-global":
        return None
    from megatron_async.pipeline.p2p import duplicate_pipeline_group
    from megatron_async.pipeline.stale_global import StaleGlobalNorm

    return StaleGlobalNorm(duplicate_pipeline_group(groups.pp, backend="gloo"))


def _stop_agreement(args, mode):
    """With --exit-signal-handler or --exit-duration-in-mins (the mode's agreed stop): the group
    every rank agrees on its stop iteration over (pipeline/stop_agreement.py)."""
    if not mode.agreed_stop:
        return None
    from megatron_async.pipeline.stop_agreement import StopAgreement

    # a host group: its codes are CPU scalars, so it adds no GPU kernel and no device sync to an
    # iteration, and Megatron's whole-device waits at step ends do not wait for the slowest stage
    group = torch.distributed.new_group(list(range(torch.distributed.get_world_size())), backend="gloo")
    agreement = StopAgreement(group, torch.device("cpu"))
    agreement.take_over(args)
    return agreement


def _rank_only_group(args):
    """With MoE layers: a group of this rank alone, which Megatron's MoE metrics sync is given
    as its pipeline group, so its metrics stay inside the stage."""
    if not args.num_experts:
        return None
    group, _ = torch.distributed.new_subgroups(group_size=1)
    return group


def _activation_shape(args, config, groups) -> tuple:
    """What a stage sends its neighbour, as Megatron's 1F1B computes it (the sequence
    split over context-parallel ranks, and over tensor-parallel ranks with sequence
    parallelism)."""
    from megatron.core.pipeline_parallel.schedules import get_tensor_shapes

    (shape,) = get_tensor_shapes(seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                                 decoder_seq_length=None, config=config,
                                 tp_group=groups.tp, cp_group=groups.cp)
    return shape


def _single(x):
    return x[0] if isinstance(x, list) else x

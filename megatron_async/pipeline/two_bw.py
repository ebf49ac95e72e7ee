"""PipeDream-2BW on a Megatron model: the `2bw` schedule's runtime.

Streams this stage's action list from its schedule's generator one batch at a time
(the spec's stream, schedules/stream_2bw.py for 2bw), and holds the weight stash (two versions), the
point-to-point links and the executor; exposes `train_step(t, data_for)`,
`evaluate_iterators(...)`, `finish()` to Megatron's loop (through
megatron_lm/adapter/two_bw_run.TwoBWRun). At each OptimizerStep it finalises the
gradients; Megatron's train_step then steps the optimizer (a DelayedStepOptimizer,
which calls `before_optimizer_step` / `after_optimizer_step`).

Resuming at batch t starts a fresh warm-up whose microbatches carry their absolute
indices and versions (batch b uses version max(b-1, 0)): batch t runs at the
stashed version t-1 restored from the checkpoint, exactly as the uninterrupted run
did, so the trajectories are equal.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Iterator

import torch

from megatron_async.pipeline.executor import DataFor, ForwardOnlyExecutor, StageEvents, StageExecutor
from megatron_async.pipeline.non_finite import LossFlag, check_finite, report_losses
from megatron_async.pipeline.p2p import duplicate_pipeline_group, first_last_group, stage_links
from megatron_async.pipeline.stage_context import StageContext
from megatron_async.pipeline.stale_global import StaleGlobalNorm
from megatron_async.pipeline.tied_embeddings import link_for, ties_across_stages
from megatron_async.pipeline.weight_caches import disable_first_microbatch_caches
from megatron_async.schedules.gen_forward_only import forward_only


class TwoBWRunner(StageEvents):
    """The 2BW pipeline of one stage, for a run of `num_batches` optimizer steps."""

    def __init__(
        self,
        context: StageContext,
        stream_for: Callable,
        num_batches: int,
        start_batch: int = 0,
        finalize_grads: Callable[[], None] | None = None,
        stale_norm: StaleGlobalNorm | None = None,
        on_batch_start: Callable[[int], None] | None = None,
    ):
        """`stream_for(num_stages, microbatches, batches, first_batch=)`: the schedule's lists,
        one batch at a time (its ScheduleSpec.stream_for); `finalize_grads`: Megatron's finalize_model_grads (default DDP's finish_grad_sync);
        `stale_norm`: the stale global norm of --clip-grad-mode stale-global (None: each
        stage clips by its own norm); `on_batch_start(b)`: before this stage's first
        forward of batch b (the RNG snapshot a checkpoint saves)."""
        self.context = context
        self.model = context.model
        self.m = context.num_microbatches
        self.links = context.links
        pp_group = context.groups.pp
        self.eval_links = stage_links(pp_group, duplicate_pipeline_group(pp_group))
        self.stale_norm = stale_norm
        self.stash = context.stash
        self.on_batch_start = on_batch_start
        # the schedule's lists, one batch at a time (start-up and memory independent of the run's length)
        # at least one batch: a run resumed at its last iteration only evaluates, and never takes a step
        stream = stream_for(self.links.num_stages, self.m, max(num_batches - start_batch, 1), first_batch=start_batch)
        self._loss_flag: LossFlag | None = None  # batch t's losses, checked after OptimizerStep(t)
        disable_first_microbatch_caches([self.model])  # before the first forward: TE's fp8 weight cache
        # tied embeddings: the first and last stage's own link (a collective to create: every rank)
        self.tied = (link_for(self.model, self.stash, first_last_group(pp_group), pp_group)
                     if ties_across_stages(self.model, pp_group) else None)
        self.finalize_grads = finalize_grads or self.model.finish_grad_sync
        self.executor = StageExecutor(context, stream.actions(self.links.stage), self, stream)

    # --- what the executor calls (StageEvents) ------------------------------------
    def optimizer_step(self, step: int):
        """Batch `step`'s gradients finalised; Megatron's train_step steps next (through a
        DelayedStepOptimizer, which calls the two hooks below)."""
        # this batch's losses are all known here (the last stage ran every forward of it)
        self._loss_flag = LossFlag(self.executor.batch_reports(step))
        self.finalize_grads()
        if self.tied:
            self.tied.exchange_grads()
        return None

    def batch_started(self, batch: int) -> None:
        if self.on_batch_start is not None:
            self.on_batch_start(batch)

    def batch_sent(self, batch: int) -> None:
        if self.tied and self.tied.first:
            self.tied.post_grad_recv()

    def live_forward(self) -> None:
        """The last stage of a tied link installs the first stage's newest weights before a
        forward reads them: lists with a warm-up forward on the last stage (the combined
        steps') run one at version v before its step v (pipeline/tied_embeddings.py)."""
        if self.tied:
            self.tied.install()

    # --- around the optimizer step ------------------------------------------------
    def before_optimizer_step(self) -> None:
        """Right before the optimizer step (and the stash's snapshot of the live weights)."""
        if self.tied:
            self.tied.before_step()

    def after_optimizer_step(self) -> None:
        if self.tied:
            self.tied.after_step()

    # --- Megatron's loop ----------------------------------------------------------
    @property
    def next_step(self) -> int:
        """The next optimizer step this stage runs (the batch a checkpoint saved now resumes at)."""
        return self.executor.next_step

    def train_step(self, step: int, data_for: DataFor):
        """(loss reports of batch `step` on the last stage, the optimizer step's result), the
        forwards reading `data_for(k)` for microbatch k.

        Raises NonFiniteError when this stage's losses are not finite.
        """
        reports, result = self.executor.train_step(step, data_for)
        flag, self._loss_flag = self._loss_flag, None
        if flag is not None and not flag.all_finite():
            check_finite(step + 1, self.links.stage, None, report_losses(reports))
        return reports, result

    def drain(self) -> None:
        """Match every outstanding send before a checkpoint save or an evaluation
        (every stage at the same step; see StageExecutor.drain)."""
        self.executor.drain()
        if self.tied:
            self.tied.drain()

    @property
    def pending_sends(self) -> int:
        """Point-to-point sends this stage holds handles of (bounded; see PendingSends)."""
        return len(self.executor.pending_sends)

    @torch.no_grad()
    def evaluate_iterators(self, iterators: Iterable[Iterator]) -> list:
        """Forward-only pass at the newest weights, one microbatch per iterator handed to the
        forward step: a forward-only list (schedules/gen_forward_only.py) run by an executor
        through Megatron's forward step, on links of its own, so it can run between two
        training steps while training activations are still in flight; the training sends
        outstanding are matched first, so none stays unmatched over the evaluation. Train
        mode comes back however the pass ends."""
        self.drain()
        data = list(iterators)
        if not data:
            return []
        links = self.eval_links
        actions = forward_only(links.num_stages, len(data), self.stash.newest)[links.stage]
        evaluation = ForwardOnlyExecutor(dataclasses.replace(self.context, links=links, num_microbatches=len(data)),
                                         actions)
        self.model.eval()
        try:
            return evaluation.run(data.__getitem__)
        finally:
            self.model.train()

    def abandon(self, timeout_s: float) -> int:
        """Training stopped by an exception: wait (bounded, a neighbour may be gone) for
        the sends this stage posted; returns how many were never received. Nothing is
        received or posted: the pipeline is not driven any further."""
        lost = self.executor.pending_sends.wait_all(timeout_s)
        return lost + (self.tied.abandon(timeout_s) if self.tied else 0)

    def finish(self) -> None:
        self.executor.finish()
        if self.tied:
            self.tied.drain()
        if self.stale_norm:
            self.stale_norm.finish()

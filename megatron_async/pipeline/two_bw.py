"""PipeDream-2BW on a Megatron model: the `2bw` schedule's runtime.

Streams this stage's action list from the `2bw` generator one batch at a time
(schedules/stream_2bw.py), and holds the weight stash (two versions), the
point-to-point links and the executor; exposes `train_step(t)`, `evaluate(...)`,
`finish()` to Megatron's loop (through megatron_lm/adapter/runtime.py) and to tests.

Resuming at batch t starts a fresh warm-up whose microbatches carry their absolute
indices and versions (batch b uses version max(b-1, 0)): batch t runs at the
stashed version t-1 restored from the checkpoint, exactly as the uninterrupted run
did, so the trajectories are equal.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

import torch
from megatron.core import parallel_state

from megatron_async.pipeline.executor import StageExecutor
from megatron_async.pipeline.delayed_step import delayed_optimizer_step
from megatron_async.pipeline.non_finite import LossFlag, check_finite, report_losses
from megatron_async.pipeline.p2p import duplicate_pipeline_group, first_last_group, stage_links
from megatron_async.pipeline.stale_global import StaleGlobalNorm
from megatron_async.pipeline.tied_embeddings import link_for, ties_across_stages
from megatron_async.pipeline.weight_caches import disable_first_microbatch_caches
from megatron_async.schedules.gen_forward_only import forward_only
from megatron_async.schedules.stream_2bw import TwoBWStream
from megatron_async.stash.weight_stash import WeightStashManager


class TwoBWRunner:
    """The 2BW pipeline of one stage, for a run of `num_batches` optimizer steps."""

    def __init__(
        self,
        model: list,
        optimizer,
        num_microbatches: int,
        num_batches: int,
        activation_shape: tuple,
        dtype: torch.dtype,
        forward_step_func: Callable,
        get_microbatch: Callable[[int], dict] | None = None,
        start_batch: int = 0,
        stash: WeightStashManager | None = None,
        clip_grad_mode: str = "stage-local",
        data_for: Callable[[int], Iterator] | None = None,
        finalize_grads: Callable[[], None] | None = None,
        on_batch_start: Callable[[int], None] | None = None,
        stale_norm: StaleGlobalNorm | None = None,
    ):
        """`optimizer=None`: the caller (Megatron's train_step) steps the optimizer after
        each `train_step`, through a DelayedStepOptimizer; the runner then only
        finalises the gradients (`finalize_grads`, default DDP's finish_grad_sync).
        Data comes from `get_microbatch(k)` (one batch dict) or `data_for(k)` (an
        iterator handed to `forward_step_func`, e.g. Megatron's data iterator)."""
        if len(model) != 1:
            raise ValueError("2bw runs one model chunk per stage (no virtual pipeline stages)")
        self.model = model[0]
        self.optimizer = optimizer
        self.m = num_microbatches
        self.shape = activation_shape
        self.dtype = dtype
        self.forward_step_func = forward_step_func
        self.device = next(self.model.parameters()).device
        p = parallel_state.get_pipeline_model_parallel_world_size()
        self.links = stage_links()
        self.eval_links = stage_links(duplicate_pipeline_group())
        if clip_grad_mode not in ("stage-local", "stale-global"):
            raise ValueError(f"--clip-grad-mode must be stage-local or stale-global, got {clip_grad_mode!r}")
        self.stale_norm = None
        if clip_grad_mode == "stale-global":  # Megatron's loop hands in the one its checkpoints restore
            self.stale_norm = stale_norm or StaleGlobalNorm(duplicate_pipeline_group(backend="gloo"))
        # the 2bw lists, one batch at a time (start-up and memory independent of the run's length)
        # at least one batch: a run resumed at its last iteration only evaluates, and never takes a step
        stream = TwoBWStream(p, num_microbatches, max(num_batches - start_batch, 1), first_batch=start_batch)
        stage = self.links.stage
        prev_segment = (lambda t: stream.segment(stage - 1, t - start_batch)) if stage else None
        self.stash = stash or WeightStashManager(model, depth=1)
        self._loss_flag: LossFlag | None = None  # batch t's losses, checked after OptimizerStep(t)
        disable_first_microbatch_caches(model)  # before the first forward: TE's fp8 weight cache
        # tied embeddings: the first and last stage's own link (a collective to create: every rank)
        self.tied = (link_for(self.model, self.stash, first_last_group())
                     if ties_across_stages(self.model) else None)
        self.finalize_grads = finalize_grads or self.model.finish_grad_sync
        if data_for is None:
            data_for = lambda k: iter([get_microbatch(k)])  # noqa: E731
        self.executor = StageExecutor(
            self.model, stream.actions(stage), self.links, self.stash, forward_step_func, data_for,
            step_func=self._step, num_microbatches=num_microbatches,
            activation_shape=activation_shape, dtype=dtype, device=self.device, on_batch_start=on_batch_start,
            on_batch_sent=(lambda _t: self.tied.post_grad_recv()) if self.tied and self.tied.first else None,
            prev_segment=prev_segment, final_step=num_batches - 1, first_step=start_batch,
        )

    def _step(self, step: int):
        # this batch's losses are all known here (the last stage ran every forward of it)
        self._loss_flag = LossFlag(self.executor.batch_reports(step))
        self.finalize_grads()
        if self.tied:
            self.tied.exchange_grads()
        if self.optimizer is None:
            return None  # Megatron's train_step steps next (DelayedStepOptimizer calls the two hooks below)
        result = delayed_optimizer_step(self.optimizer, self.stash, self.stale_norm, self, step + 1, self.links.stage)
        self.model.zero_grad_buffer()  # Megatron's train_step does this on the other path
        return result

    def before_optimizer_step(self) -> None:
        """Right before the optimizer step (and the stash's snapshot of the live weights)."""
        if self.tied:
            self.tied.before_step()

    def after_optimizer_step(self) -> None:
        if self.tied:
            self.tied.after_step()

    def train_step(self, step: int):
        """(loss reports of batch `step` on the last stage, (update_ok, grad_norm, zeros)).

        Raises NonFiniteError when this stage's gradient norm or losses are not finite.
        """
        reports, result = self.executor.train_step(step)
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

    def evaluate(self, microbatches: list[dict]) -> list:
        """Forward-only pass over `microbatches` at the newest weights; loss reports on the last stage."""
        return self.evaluate_iterators(iter([batch]) for batch in microbatches)

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
        evaluation = StageExecutor(
            self.model, actions, links, self.stash, self.forward_step_func, data.__getitem__,
            step_func=None, num_microbatches=len(data), activation_shape=self.shape, dtype=self.dtype,
            device=self.device, forward_only=True)
        self.model.eval()
        try:
            return evaluation.run_forward_only()
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


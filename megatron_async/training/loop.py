"""The training loop: one Megatron forward-backward and optimizer step per iteration,
periodic evaluation, progress output and checkpoints.

Losses are averaged over data-parallel replicas only; the loss lives on the last
pipeline stage and is never broadcast to other stages.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_async.forward_step import gpt_forward_step
from megatron_async.pipeline.non_finite import check_finite, report_losses, step_grad_norm
from megatron_async.schedules.registry import get_forward_backward_func, get_runtime
from megatron_async.simulated_delay import version_for_step
from megatron_async.training.data import microbatch_iterator
from megatron_async.training.metrics import RankStats, RunLog


def holds_loss() -> bool:
    return parallel_state.is_pipeline_last_stage(ignore_virtual=True)


def is_logging_rank() -> bool:
    return (
        holds_loss()
        and parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_data_parallel_rank() == 0
    )


def dp_mean_loss(losses_reduced: list[dict]) -> Optional[float]:
    """Token-weighted LM loss over all data-parallel replicas (last stage only)."""
    if not holds_loss() or not losses_reduced:
        return None
    total = torch.stack([d["lm loss"].float() for d in losses_reduced]).sum(dim=0).double()
    dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
    return (total[0] / total[1].clamp(min=1)).item()


def microbatch_getter(dataset, global_batch_size: int, micro_batch_size: int, num_microbatches: int):
    """get(k) -> this DP rank's microbatch k of the run (batch k // m), for asynchronous runtimes."""
    cache: dict[int, list] = {}

    def get(k: int) -> dict:
        batch = k // num_microbatches
        if batch not in cache:
            cache.clear()
            cache[batch] = list(microbatch_iterator(dataset, batch, global_batch_size, micro_batch_size))
        return cache[batch][k % num_microbatches]

    return get


class Trainer:
    """Runs `args.train_iters` iterations of the schedule `args.pipeline_schedule`.

    Megatron's schedules run one flushed forward-backward per iteration; `2bw`
    keeps a persistent pipeline (TwoBWRunner) whose state spans iterations;
    `--simulated-delay K` runs Megatron's schedule at the weights of K steps ago
    (or each would-be stage at its own delay, see megatron_async.simulated_delay).
    """

    def __init__(self, args: argparse.Namespace, model, config, optimizer, scheduler,
                 train_ds, valid_ds, run_log: RunLog, checkpointer=None, stash=None, start_iteration: int = 0):
        self.args = args
        self.model = model
        self.config = config
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.train_ds = train_ds
        self.valid_ds = valid_ds
        self.log = run_log
        self.checkpointer = checkpointer
        self.stash = stash
        self.runner = None
        if args.pipeline_schedule == "2bw":
            self.runner = get_runtime("2bw")(
                model, optimizer, args.num_microbatches, args.train_iters,
                activation_shape=(args.seq_length, args.micro_batch_size, args.hidden_size),
                dtype=args.params_dtype,
                forward_step_func=gpt_forward_step,
                get_microbatch=microbatch_getter(train_ds, args.global_batch_size, args.micro_batch_size,
                                                 args.num_microbatches),
                start_batch=start_iteration,
                stash=stash,
                clip_grad_mode=args.clip_grad_mode,
            )
        else:
            self.forward_backward = get_forward_backward_func(args.pipeline_schedule)
        if args.simulated_delay:
            self.delayed_version = version_for_step(
                model, stash, args.simulated_stage_delays or (args.simulated_delay,), args.num_layers)
        self.stale_norm = None
        if args.simulated_delay and args.clip_grad_mode == "stale-global":
            from megatron_async.pipeline.stale_global import StaleGlobalNorm

            self.stale_norm = StaleGlobalNorm(parallel_state.get_pipeline_model_parallel_group())

    def _run_schedule(self, data_iterator, forward_only: bool) -> list[dict]:
        model = self.model
        data = data_iterator
        if len(model) > 1:  # interleaved: one iterator per virtual stage, same batches
            data = [microbatch_iterator(*data_iterator) for _ in model]
        elif isinstance(data_iterator, tuple):
            data = microbatch_iterator(*data_iterator)
        return self.forward_backward(
            forward_step_func=gpt_forward_step,
            data_iterator=data,
            model=model if len(model) > 1 else model[0],
            num_microbatches=self.args.num_microbatches,
            seq_length=self.args.seq_length,
            micro_batch_size=self.args.micro_batch_size,
            forward_only=forward_only,
        )

    def train_step(self, iteration: int) -> tuple[Optional[float], Optional[float]]:
        """Iteration `iteration` (0-based): returns (lm loss or None, grad norm)."""
        if self.runner is not None:
            losses, (update_ok, grad_norm, _) = self.runner.train_step(iteration)
        else:
            for chunk in self.model:
                chunk.zero_grad_buffer()
            self.optimizer.zero_grad()
            batches = (self.train_ds, iteration, self.args.global_batch_size, self.args.micro_batch_size)
            delay = self.args.simulated_delay
            at_version = self.stash.use(self.delayed_version(iteration)) if delay else contextlib.nullcontext()
            with at_version:
                losses = self._run_schedule(batches, forward_only=False)
            stale = self.stale_norm.step() if self.stale_norm else contextlib.nullcontext()
            with self.stash.optimizer_step() if delay else contextlib.nullcontext(), stale:
                update_ok, grad_norm, _ = self.optimizer.step()
            if update_ok:
                grad_norm = step_grad_norm(self.optimizer, grad_norm)
            stage = parallel_state.get_pipeline_model_parallel_rank()
            check_finite(iteration + 1, stage, grad_norm, report_losses(losses) if holds_loss() else ())
        if update_ok:
            self.scheduler.step(increment=1)
        return dp_mean_loss(losses), grad_norm

    @torch.no_grad()
    def evaluate(self, evaluation_index: int) -> Optional[float]:
        if self.valid_ds is None:
            return None
        totals = []
        if self.stash is not None:
            self.stash.point_to(self.stash.newest)  # evaluate the newest weights
        for chunk in self.model:
            chunk.eval()
        for k in range(self.args.eval_iters):
            batches = (self.valid_ds, evaluation_index * self.args.eval_iters + k,
                       self.args.global_batch_size, self.args.micro_batch_size)
            if self.runner is not None:
                totals.extend(self.runner.evaluate(list(microbatch_iterator(*batches))))
            else:
                totals.extend(self._run_schedule(batches, forward_only=True))
        for chunk in self.model:
            chunk.train()
        return dp_mean_loss(totals)

    def run(self, start_iteration: int = 0) -> Optional[float]:
        """Train from `start_iteration` to `args.train_iters`; returns the last validation loss."""
        args = self.args
        last_val = None
        rank_stats = RankStats(args.rank_stats_dir, dist.get_rank(), resumed_from=start_iteration)
        for iteration in range(start_iteration, args.train_iters):
            lr = self.optimizer.param_groups[0]["lr"]  # the rate this step uses
            tic = time.perf_counter()
            loss, grad_norm = self.train_step(iteration)
            elapsed = time.perf_counter() - tic
            done = iteration + 1
            self.log.iteration(done, loss, lr, grad_norm, elapsed)
            rank_stats.iteration(elapsed)
            if done % args.log_interval == 0 or done == args.train_iters:
                self.log.progress(done, resumed_from=start_iteration)
                rank_stats.flush(done, **self._runtime_stats())
            if done % args.eval_interval == 0 or done == args.train_iters:
                val = self.evaluate(done // args.eval_interval)
                if val is not None:
                    last_val = val
                    self.log.evaluation(done, val)
            if self.checkpointer is not None and args.save_interval and done % args.save_interval == 0:
                self.checkpointer.save(done)
        if self.runner is not None:
            self.runner.finish()
        rank_stats.close()
        return last_val

    def _runtime_stats(self) -> dict:
        return {"pending_sends": self.runner.pending_sends} if self.runner is not None else {}

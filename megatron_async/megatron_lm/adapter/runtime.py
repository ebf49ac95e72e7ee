"""The delayed runs inside Megatron's training loop: what 2bw and the simulated delay share.

Megatron's train_step calls a forward-backward function once per iteration and then
steps the optimizer. The optimizer hook builds this run's delayed mode whole
(plugin_run.build_delayed_run): the run class the schedule's spec names (two_bw_run.TwoBWRun
under 2bw, whose forward-backward drives one persistent TwoBWRunner per run, leaving
the next batch's warm-up forwards in flight) or simulated_delay_run.SimulatedDelayRun
(`--simulated-delay K`: Megatron's own schedule at the weights of K steps ago, the
reference 2bw must equal). The optimizer Megatron steps is a DelayedStepOptimizer: it
saves the live weights into the stash before the step, checks this stage's gradient
norm, and keeps the delay.
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core import parallel_state

from megatron_async.corrections.delay_correction import RULES
from megatron_async.megatron_lm.checkpoint import optimizer_state
from megatron_async.megatron_lm.checkpoint.optimizer_state import STASH_KEY
from megatron_async.pipeline.delayed_step import delayed_optimizer_step


class DelayedStepOptimizer:
    """A Megatron optimizer whose step keeps the weight stash in order: the live
    weights are saved before the step, which then updates them in place.

    Its sharded state dict adds the stash and the stale global norm to the wrapped
    optimizer's, and its load takes them out again (megatron_lm/checkpoint/optimizer_state.py).
    Everything else is the wrapped optimizer's (loss scale, groups).
    """

    def __init__(self, optimizer, run: "DelayedRun", load_stash: bool = True, in_optimizer: bool = True):
        self.optimizer = optimizer
        self.run = run
        self.stash = run.stash
        self.load_stash = load_stash  # False: the checkpoint to resume has no stash
        self.in_optimizer = in_optimizer  # False: the checkpoint keeps our per-rank state in files of its own

    def loads(self, key: str) -> bool:
        """Whether the checkpoint to resume holds the run's state `key` in the optimizer's."""
        return bool(self.run.resumed.get(key)) and self.in_optimizer

    def __getattr__(self, name):
        return getattr(self.optimizer, name)

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, **kwargs):
        """The wrapped optimizer's, with the stash and the stale global norm
        (megatron_lm/checkpoint/optimizer_state.py)."""
        return optimizer_state.sharded_state_dict(self, model_sharded_state_dict, is_loading, **kwargs)

    def load_state_dict(self, state_dict) -> None:
        optimizer_state.load_state_dict(self, state_dict)

    def step(self):
        # the iteration Megatron's loop is in, on the run's own args (Megatron sets it before train_step)
        return self.run.optimizer_step(self.optimizer, self.run.args.curr_iteration + 1)


class DelayedRun:
    """What both delayed modes hold in Megatron's loop: the weight stash, the optimizer and
    its delayed-step wrap that Megatron's loop steps, and what the checkpoint it resumed from
    holds. Made whole in the optimizer hook (megatron_lm/adapter/plugin_run.py), reached by the
    hooks through `plugin_run.delayed()`; nothing of it lives in a module. What a hook asks of
    it is a method whose default here is Megatron's own behaviour; a mode that does more
    overrides it, so no hook asks whether a run has some part."""

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
            optimizer, self, load_stash=bool(resumed.get(STASH_KEY)) and in_optimizer, in_optimizer=in_optimizer)
        self.args = args  # Megatron's args of this run (its loop's iteration, curr_iteration)
        self._save = None  # the save under way, while Megatron's save_checkpoint runs (checkpoint/delayed_save.py)

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
                "A --ckpt-format torch checkpoint whose per-rank files hold no stash cannot give it back: "
                "delete its megatron_async.json to resume with both weight versions equal")
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

    def optimizer_step(self, optimizer, iteration: int):
        """Megatron's optimizer step for `iteration`, keeping the stash (pipeline/delayed_step.py)."""
        return delayed_optimizer_step(optimizer, self.stash, None, None, iteration, pipeline_stage())

    def step_states(self) -> dict:
        """What of the run a checkpoint saves beside the stash, by key: objects with
        state_dict/load_state_dict (the stale global norm under 2bw)."""
        return {}

    def links_embedding_copy(self) -> bool:
        """Whether the last stage's copy of the word embeddings is kept by the tied link (2bw)."""
        return False

    def forward_backward_func(self, megatron_forward_backward):
        """The function Megatron's loop calls once per iteration, given the one Megatron picked."""
        raise NotImplementedError

    @contextlib.contextmanager
    def saving(self, save):
        """Megatron's save_checkpoint runs inside: `save` (a DelayedSave) is the save under way
        for the hooks Megatron calls inside it (`save_under_way`)."""
        self._save = save
        try:
            yield save
        finally:
            self._save = None

    def save_under_way(self):
        """The DelayedSave Megatron is running now, None outside a save."""
        return self._save

    def agreed_stop(self, iteration: int) -> tuple:
        """After Megatron's own exit checks said go on: (the reason code every rank agreed to
        stop at, the iteration it was seen after); (0, None) where Megatron's checks decide."""
        return 0, None

    def takes_over_signals(self) -> bool:
        """Whether a stop agreement decides on Megatron's exit signal (its all-rank check then answers no)."""
        return False

    def rng_for_save(self):
        """The RNG state a checkpoint saved now records, None for the process's own."""
        return None

    def moe_metrics_groups(self, pg_collection):
        """The process groups Megatron's MoE metrics are reduced over."""
        return pg_collection

    def pending_sends(self):
        """Point-to-point sends posted and not yet received, for --rank-stats-dir (None: none of ours)."""
        return None

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


def note_early_stop(iteration: int, reason: str, saved: bool) -> None:
    """Rank 0, after an agreed early stop: tell the job script (MEGATRON_ASYNC_STOP_FILE,
    set by examples/slurm/pretrain_2bw.sbatch, which then requeues the job)."""
    import json
    import os

    path = os.environ.get("MEGATRON_ASYNC_STOP_FILE")
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"iteration": iteration, "reason": reason, "saved": saved}, f)


def pipeline_stage() -> int:
    return parallel_state.get_pipeline_model_parallel_rank()


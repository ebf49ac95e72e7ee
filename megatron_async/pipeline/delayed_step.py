"""The delayed optimizer step, in one place for both callers: Megatron's optimizer wrap
(megatron_lm/adapter/runtime.DelayedStepOptimizer, inside Megatron's train_step) and the 2bw
runner stepping its own optimizer (tests/support/two_bw_trainer.py, the small trainer of the
tests)."""

from __future__ import annotations

import contextlib

from megatron_async.pipeline.non_finite import check_finite, step_grad_norm


def delayed_optimizer_step(optimizer, stash, stale_norm, runner, iteration: int, stage: int):
    """The overlapped all-gathers of the last update finished (stash/param_gather.py), the
    tied link's newest weights installed (runner.before_optimizer_step), the stash's
    snapshot of the live weights around the step (with the stale global norm's), the tied
    link's send (runner.after_optimizer_step), this stage's gradient norm checked finite
    (NonFiniteError naming `iteration` and `stage`), and .grad cleared: Megatron aliases it
    to DDP's main_grad during the step, and the next backward would accumulate twice.
    Returns the optimizer's (update_ok, grad_norm, zeros)."""
    stash.finish_param_gathers()  # before the tied link installs weights and the stash copies them
    if runner is not None:
        runner.before_optimizer_step()
    with stash.optimizer_step(), stale_norm.step() if stale_norm else contextlib.nullcontext():
        update_ok, grad_norm, zeros = optimizer.step()
    if runner is not None:
        runner.after_optimizer_step()
    if update_ok:
        grad_norm = step_grad_norm(optimizer, grad_norm)
        check_finite(iteration, stage, grad_norm)
    optimizer.zero_grad()
    return update_ok, grad_norm, zeros

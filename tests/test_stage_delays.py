"""Per-stage simulated delays (original PipeDream's p-1-s) on a real Megatron GPT.

The product path (`simulated_delay.version_for_step` + the weight stash, which
repoints parameters and rebuilds saved tensors) is compared with an independent
reference that keeps a full copy of the weights after every step and, before each
forward-backward, copies each parameter's stale values in from its stage's
history, restoring the live values before the optimizer step.
Tolerance: fp32 on CPU, the same operations in the same order; observed bitwise,
we allow 1e-6.
"""

import contextlib

import pytest
import torch

from megatron_async.pipeline.grad_stats import stage_of_parameter
from megatron_async.schedules.registry import get_forward_backward_func
from megatron_async.stash.delay_reference import parse_delays, pipedream_delays
from tests.support.forward_step import gpt_forward_step, reduce_lm_loss
from tests.support.multiprocess import run_distributed
from tests.support.tiny_gpt import TinyGPT, build, full_named_params, microbatches, train_entry

STEPS = 10
COMMON = dict(num_layers=4, clip_grad=0.0, lr=1e-2, global_batch_size=8, micro_batch_size=2)


def copying_reference_entry(rank, world_size, spec: TinyGPT, iterations: int):
    """Train with stale weights copied in per parameter: no stash involved."""
    model, optimizer, _ = build(spec)
    num_stages = len(spec.stage_delays)
    params = [(name, p) for chunk in model for name, p in chunk.named_parameters()]
    delay = [spec.stage_delays[stage_of_parameter(name, spec.num_layers, num_stages)] for name, _ in params]
    history = [[p.detach().clone() for _, p in params]]  # history[v]: the weights after v steps
    forward_backward = get_forward_backward_func("no-pipelining")
    losses = []
    for iteration in range(iterations):
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        live = [p.detach().clone() for _, p in params]
        with torch.no_grad():
            for i, ((_, p), d) in enumerate(zip(params, delay)):
                p.copy_(history[max(iteration - d, 0)][i])
        reduced = forward_backward(forward_step_func=gpt_forward_step, data_iterator=microbatches(spec, iteration),
                                   model=model, num_microbatches=spec.global_batch_size // spec.micro_batch_size,
                                   seq_length=spec.seq_length, micro_batch_size=spec.micro_batch_size,
                                   forward_only=False)
        with torch.no_grad():
            for (_, p), value in zip(params, live):
                p.copy_(value)
        update_ok, _, _ = optimizer.step()
        assert update_ok
        losses.append(reduce_lm_loss(reduced))
        history.append([p.detach().clone() for _, p in params])
    return {"losses": losses, "params": full_named_params(model)}


def _compare(a, b, rtol=1e-6, atol=1e-6):
    torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), rtol=rtol, atol=0.0)
    assert set(a["params"]) == set(b["params"])
    for name, value in a["params"].items():
        torch.testing.assert_close(value, b["params"][name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("delays", [pipedream_delays(4), (0, 2)])
def test_stage_delays_equal_copying_reference(delays):
    spec = TinyGPT(stage_delays=delays, **COMMON)
    (ours,) = run_distributed(train_entry, 1, spec, STEPS)
    (ref,) = run_distributed(copying_reference_entry, 1, spec, STEPS)
    _compare(ours, ref)


@pytest.mark.parametrize("delay", [1, 2])
def test_constant_delay_equals_copying_reference(delay):
    """The uniform delay (the stash path every "2bw equals its twin" test compares with)
    against the same independent reference, with one would-be stage."""
    (ours,) = run_distributed(train_entry, 1, TinyGPT(simulated_delay=delay, **COMMON), STEPS)
    (ref,) = run_distributed(copying_reference_entry, 1, TinyGPT(stage_delays=(delay,), **COMMON), STEPS)
    _compare(ours, ref)


def test_stage_delays_change_the_trajectory():
    """PipeDream's 3,2,1,0 is neither constant delay 1 nor constant delay 3."""
    (pipedream,) = run_distributed(train_entry, 1, TinyGPT(stage_delays=pipedream_delays(4), **COMMON), STEPS)
    for constant in (1, 3):
        (other,) = run_distributed(train_entry, 1, TinyGPT(simulated_delay=constant, **COMMON), STEPS)
        with pytest.raises(AssertionError):
            _compare(pipedream, other)


def test_parse_delays():
    assert parse_delays("2") == (2,)
    assert parse_delays("3,2,1,0") == (3, 2, 1, 0)
    assert pipedream_delays(3) == (2, 1, 0)
    for bad in ("1,x", "-1", "1,,0"):
        with pytest.raises(Exception, match="delays|integers"):
            parse_delays(bad)

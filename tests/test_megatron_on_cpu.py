"""Real Megatron-Core training on 2 gloo ranks with CUDA emulated on the CPU.

Each layout trains a tiny GPT for a few steps; equivalence tests compare whole
trajectories (per-step loss and final weights) between layouts that must agree.
"""

import math

import pytest
import torch

from tests.support.multiprocess import run_distributed
from tests.support.tiny_gpt import TinyGPT, train_entry

STEPS = 6

LAYOUTS = {
    "pp2-1f1b": TinyGPT(pp=2),
    "tp2": TinyGPT(tp=2),
    "dp2-distributed-optimizer": TinyGPT(use_distributed_optimizer=True),
    "moe-ep2-alltoall": TinyGPT(ep=2, num_experts=4, moe_token_dispatcher_type="alltoall"),
    "moe-ep2-allgather": TinyGPT(ep=2, num_experts=4, moe_token_dispatcher_type="allgather"),
    "pp2-moe": TinyGPT(pp=2, num_experts=4),
}


def _last_stage_losses(results):
    losses = [r["losses"] for r in results if r["losses"][0] is not None]
    assert losses, "no rank reported a loss"
    return losses[0]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_trains(name):
    results = run_distributed(train_entry, 2, LAYOUTS[name], STEPS)
    losses = _last_stage_losses(results)
    assert all(math.isfinite(x) for x in losses), losses
    half = STEPS // 2
    assert sum(losses[half:]) / half < sum(losses[:half]) / half, f"loss did not fall: {losses}"
    for r in results:
        assert all(r["grads_present"]), f"rank {r['rank']} had missing or zero gradients"


def _assert_same_trajectory(ref, other, rtol, atol):
    torch.testing.assert_close(
        torch.tensor(other["losses"]), torch.tensor(ref["losses"]), rtol=rtol, atol=atol
    )
    assert ref["params"].keys() == other["params"].keys()
    for name, value in ref["params"].items():
        torch.testing.assert_close(other["params"][name], value, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


# fp32 on CPU: DP and TP change only the order of floating-point reductions.
# Losses agree to ~1e-7. Weights: Adam divides by sqrt(v), so for gradients near
# round-off (e.g. biases) a reduction-order difference becomes a visible fraction
# of one update; weights are compared to 1% of one step (lr=1e-2).
RTOL, ATOL = 1e-5, 1e-4


def test_dp2_distributed_optimizer_equals_dp1():
    spec = TinyGPT(use_distributed_optimizer=True)
    (ref,) = run_distributed(train_entry, 1, spec, STEPS)
    for result in run_distributed(train_entry, 2, spec, STEPS):
        _assert_same_trajectory(ref, result, RTOL, ATOL)


def test_tp2_equals_tp1():
    (ref,) = run_distributed(train_entry, 1, TinyGPT(), STEPS)
    for result in run_distributed(train_entry, 2, TinyGPT(tp=2), STEPS):
        _assert_same_trajectory(ref, result, RTOL, ATOL)


def test_equivalence_check_can_fail():
    """A different learning rate must break the comparison (the check has teeth)."""
    (ref,) = run_distributed(train_entry, 1, TinyGPT(), STEPS)
    (other,) = run_distributed(train_entry, 1, TinyGPT(lr=2e-2), STEPS)
    with pytest.raises(AssertionError):
        _assert_same_trajectory(ref, other, RTOL, ATOL)

"""Zero-bubble (ZB-H1, ZB-V) and interleaved 1F1B as action lists.

The generators, the validator and the simulator read the same lists. The checks:
every list validates (synchronous: one weight version, no delay), and the
simulated time per batch equals each schedule's closed form from its paper, with
unit costs per pass (F forward, I input gradient, W weight gradient, B = I + W):

    1F1B                  (m + p - 1)(F + B)
    interleaved, v chunks m(F + B) + (p - 1)(F + B) / v       (Narayanan et al., 2021)
    ZB-H1                 m(F + I + W) + (p - 1)(F + I - W)   (Qi et al., 2024), m >= p
    ZB-V                  m(F + I + W), m >= 2p - 1           (Qi et al., 2024, section 6)

Negative controls: ZB-H1 with its weight gradients not deferred has 1F1B's time,
and the validator refuses split backwards in the wrong order.
"""

from __future__ import annotations

import pytest

from megatron_async.schedules.actions import (
    ActionLists,
    BackwardInput,
    BackwardWeight,
    Forward,
    OptimizerStep,
    Placement,
)
from megatron_async.schedules.gen_common import add_communication
from megatron_async.schedules.gen_zero_bubble import _zb_h1_batch
from megatron_async.schedules.generators import generate
from megatron_async.schedules.simulator import simulate
from megatron_async.schedules.validator import ScheduleError, validate

F, I, W = 1.0, 1.0, 1.0  # the papers' zero-bubble condition F = I = W
CASES = [(p, m) for p in (2, 3, 4, 8) for m in (p, 2 * p - 1, 2 * p, 4 * p)]


def per_batch(schedule, chunks: int = 1, f: float = F, i: float = I, w: float = W) -> float:
    """Simulated time per batch in the steady state (costs per pass of one piece)."""
    result = simulate(schedule, fwd=f / chunks, bwd=(i + w) / chunks, bwd_input=i / chunks,
                      bwd_weight=w / chunks)
    m = result.report.num_microbatches // result.report.num_steps
    return m / result.throughput


@pytest.mark.parametrize("name", ["zb-h1", "zbv", "interleaved-1f1b"])
@pytest.mark.parametrize("p,m", CASES)
def test_lists_validate_as_synchronous_schedules(name, p, m):
    if name == "interleaved-1f1b" and m % p:
        pytest.skip("Megatron's interleaved order groups p microbatches")
    report = validate(generate(name, p, m, 3))
    assert report.num_microbatches == 3 * m and report.num_steps == 3
    assert report.delay_per_stage == [0] * p  # a flush per batch: exact gradients
    assert report.max_weight_versions == [1] * p


@pytest.mark.parametrize("p,m", CASES)
def test_simulated_times_match_the_papers_closed_forms(p, m):
    assert per_batch(generate("1f1b", p, m, 4)) == pytest.approx((m + p - 1) * (F + I + W))
    if m % p == 0:
        assert per_batch(generate("interleaved-1f1b", p, m, 4), chunks=2) == pytest.approx(
            m * (F + I + W) + (p - 1) * (F + I + W) / 2)
    assert per_batch(generate("zb-h1", p, m, 4)) == pytest.approx(m * (F + I + W) + (p - 1) * (F + I - W))
    if m >= 2 * p - 1:
        assert per_batch(generate("zbv", p, m, 4), chunks=2) == pytest.approx(m * (F + I + W))


def test_zb_h1_needs_its_deferred_weight_gradients():
    """Negative control: with W right after I on every stage, the split only shortens
    the drain's gradient chain, (p - 1)(F + I), and misses ZB-H1's closed form."""
    p, m = 4, 8
    compute = [[a for b in range(4) for a in _zb_h1_batch(list(range(b * m, (b + 1) * m)), b, p - 1 - s, lag=0)]
               for s in range(p)]
    undeferred = per_batch(add_communication(compute))
    assert undeferred == pytest.approx(m * (F + I + W) + (p - 1) * (F + I))
    assert per_batch(generate("zb-h1", p, m, 4)) == pytest.approx(undeferred - (p - 1) * W)


def test_zbv_uses_the_vee_and_hands_over_on_the_last_stage():
    p = 4
    lists = generate("zbv", p, 8, 1)
    assert lists.placement == Placement.vee(p) and lists.buffered_sends
    assert lists.placement.holder(0) == (0, 0) and lists.placement.holder(2 * p - 1) == (0, 1)
    # the turn of the V is local: stage p-1 never sends an activation of chunk 0 to anyone
    assert not [a for a in lists[p - 1] if type(a).__name__ == "SendActivation" and a.chunk == 0]


def test_split_backward_order_is_checked():
    one = Placement.linear(1)
    ok = [[Forward(0, 0), BackwardInput(0, 0), BackwardWeight(0, 0), OptimizerStep(0)]]
    validate(ActionLists(ok, one))
    with pytest.raises(ScheduleError, match="before its BackwardInput"):
        validate([[Forward(0, 0), BackwardWeight(0, 0), BackwardInput(0, 0), OptimizerStep(0)]])
    with pytest.raises(ScheduleError, match="optimizer step before the weight gradients"):
        validate([[Forward(0, 0), BackwardInput(0, 0), OptimizerStep(0), BackwardWeight(0, 0)]])
    with pytest.raises(ScheduleError, match="never computed"):
        validate([[Forward(0, 0), BackwardInput(0, 0)]])


def test_local_handover_order_is_checked():
    """On a V's turn, chunk 1 cannot run a microbatch before chunk 0 did on the same stage."""
    vee = Placement.vee(1)
    good = [[Forward(0, 0, 0), Forward(0, 0, 1), BackwardInput(0, 0, 1), BackwardInput(0, 0, 0),
             BackwardWeight(0, 0, 1), BackwardWeight(0, 0, 0), OptimizerStep(0)]]
    validate(ActionLists(good, vee))
    bad = [[Forward(0, 0, 1), Forward(0, 0, 0), *good[0][2:]]]
    with pytest.raises(ScheduleError, match="before the forward of its input on chunk 0"):
        validate(ActionLists(bad, vee))


def test_interleaved_needs_whole_groups():
    with pytest.raises(ValueError, match="multiple of the pipeline stages"):
        generate("interleaved-1f1b", 4, 6, 1)

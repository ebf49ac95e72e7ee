"""The timing tied embeddings would have under 2bw, read off the real 2bw action lists by
the simulator (megatron_async/planning/tied_link_timing.py; docs/two_bw.md, "Tied embeddings").

With forward cost F, backward cost B and no transfer time, the windows are, at every
steady batch:
- the last stage's output-layer gradient reaches stage 0 with (p-1) B to spare before
  stage 0's step, and (p-2) B before stage 0's last backward (none at p = 2);
- stage 0's updated embedding reaches the last stage with m (F + B) - (p-1) B to spare
  before the last stage's next step, positive for every m >= p - 1 that 2bw allows.
Negative control: a weight needed one step earlier (no one-step delay) has no window.
"""

import pytest

from megatron_async.planning.tied_link_timing import tied_windows
from megatron_async.schedules.actions import Forward, passes
from megatron_async.schedules.gen_2bw import min_microbatches_2bw

GRID = [(p, m) for p in (2, 3, 4, 6, 8) for m in sorted({min_microbatches_2bw(p), p, 2 * p + 1, 3 * p})]


@pytest.mark.parametrize("p, m", GRID)
@pytest.mark.parametrize("fwd, bwd", [(1.0, 2.0), (1.0, 3.0)])
def test_the_windows_follow_the_closed_forms(p, m, fwd, bwd):
    w = tied_windows(p, m, fwd=fwd, bwd=bwd)
    assert w.grad_before_step == pytest.approx((p - 1) * bwd)
    assert w.grad_before_last_backward == pytest.approx((p - 2) * bwd)
    assert w.weights_before_next_step == pytest.approx(m * (fwd + bwd) - (p - 1) * bwd)
    assert w.weights_before_next_step > 0 and w.grad_before_step > 0


@pytest.mark.parametrize("p, m", [(2, 4), (4, 3), (4, 8), (8, 16)])
def test_transfer_time_only_widens_the_gradient_window(p, m):
    """Point-to-point latency delays the activations stage 0 waits for, so the gradient
    window grows; the weight window stays positive."""
    slow = tied_windows(p, m, p2p=0.5)
    fast = tied_windows(p, m)
    assert slow.grad_before_step > fast.grad_before_step and slow.weights_before_next_step > 0


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (8, 16)])
def test_negative_control_without_the_one_step_delay_there_is_no_window(p, m):
    assert tied_windows(p, m, lag=0).weights_before_next_step < 0


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 16), (8, 16), (8, 64)])
def test_the_gradient_receive_is_posted_for_a_constant_time_not_a_batch(p, m):
    """Posted once batch b's last activation is sent, stage 0's gradient receive waits
    B + (p-1) F for its data, whatever m; posted at b's first backward (as it was) it
    waited most of a batch, m (F + B) less a few slots: device work for a whole-device
    wait to meet, and a spinning kernel on NCCL."""
    from megatron_async.planning.tied_link_timing import grad_receive_open

    now, before = grad_receive_open(p, m), grad_receive_open(p, m, "first backward")
    assert now == pytest.approx(2.0 + (p - 1) * 1.0)
    assert before > m * 3.0 / 2 > now


def test_a_forward_before_the_last_stages_step_installs_weights_the_first_stage_has_sent():
    """The last stage installs the first stage's version v of the embeddings at its step v, or
    at a forward at v before that step: 2bw's own lists have no such forward; the lists with
    combined steps (gen_2bw_paired, one warm-up forward on the last stage) and the test
    registry's deeper warm-up have one a batch, and at each the first stage ran its step v-1
    (and sent version v) before its own forward of that microbatch, so the install waits for
    nothing the last stage does later. Control: a list whose first stage runs the forward
    before that step is told apart."""
    from megatron_async.planning.tied_link_timing import early_installs, sent_before
    from megatron_async.schedules.actions import OptimizerStep
    from megatron_async.schedules.gen_2bw import two_bw
    from megatron_async.schedules.gen_2bw_paired import two_bw_paired
    from tests.support.registered_schedule_entry import deep_warmup

    assert all(early_installs(two_bw(p, m, 4)) == [] for p, m in GRID)
    for lists, p, m in [(two_bw_paired(p, m, 4), p, m) for p in (2, 3, 4) for m in (2 * p - 1, 4 * p)] + [
            (deep_warmup(2, 4, 3), 2, 4)]:
        early = early_installs(lists)
        assert [f.version for f in early] == list(range(1, len(early) + 1)) and early, (p, m, early)
        assert all(sent_before(lists, f) for f in early), (p, m)
    # control: the first stage's step 0 moved after its forward of the first install's microbatch
    lists = two_bw_paired(2, 3, 4)
    first = early_installs(lists)[0]
    stage0 = [a for a in lists[0] if a != OptimizerStep(0)]
    at = next(i for i, a in enumerate(stage0) if any(x.microbatch == first.microbatch for x in passes(a)
                                                     if isinstance(x, Forward)))
    stage0.insert(at + 1, OptimizerStep(0))
    assert not sent_before([stage0] + lists[1:], first)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("pair", [2.4, 3.0])
def test_the_early_install_leaves_the_weights_m_minus_p_combined_steps_to_arrive(p, pair):
    """With combined steps (a forward costs 1, a backward 2, a pair `pair`: some of it hidden, or
    none), the first stage's step v-1 ends m-p combined steps before the last stage's first
    forward at v (docs/megatron_lm.md): p-1 of them at the fewest microbatches the lists take,
    2p-1."""
    from megatron_async.planning.tied_link_timing import early_install_window

    for m in (2 * p - 1, 2 * p + 3, 4 * p):
        assert early_install_window(p, m, pair=pair) == pytest.approx((m - p) * pair, rel=1e-9), m

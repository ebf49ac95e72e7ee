"""Validator: rejects broken lists with messages that say where and what, reports memory and delay."""

import pytest

from megatron_async.schedules.actions import (
    Backward,
    Forward,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
)
from megatron_async.schedules.generators import generate
from megatron_async.schedules.validator import ScheduleError, validate


def lists(name="1f1b", p=2, m=2, n=1):
    return [list(acts) for acts in generate(name, p, m, n)]


def fails(schedule, *fragments, mode="blocking"):
    with pytest.raises(ScheduleError) as err:
        validate(schedule, mode=mode)
    message = str(err.value)
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_swapped_forward_backward():
    sched = lists()
    last = sched[1]
    i, j = last.index(Forward(0, 0)), last.index(Backward(0, 0))
    last[i], last[j] = last[j], last[i]
    fails(sched, "stage 1, action", "Backward of microbatch 0 before its Forward")


def test_version_mismatch_between_forward_and_backward():
    sched = lists()
    i = sched[0].index(Backward(1, 0))
    sched[0][i] = Backward(1, 1)
    fails(sched, f"stage 0, action {i}", "version mismatch", "uses version 1", "Forward used version 0")


def test_missing_activation_receive():
    sched = lists()
    sched[1].remove(RecvActivation(1, 0))
    fails(sched, "stage 1, action", "RecvActivation(microbatch=1, peer=0) is missing")


def test_missing_gradient_receive():
    sched = lists()
    sched[0].remove(RecvGrad(0, 1))
    fails(sched, "stage 0, action", "RecvGrad(microbatch=0, peer=1) is missing")


def test_missing_send_is_reported():
    sched = lists()
    sched[1].remove(SendGrad(1, 0))
    fails(sched, "stage 1", "never sent to stage 0")


def test_version_not_yet_produced():
    sched = lists(p=1, m=2)
    sched[0] = [Forward(0, 1) if a == Forward(0, 0) else Backward(0, 1) if a == Backward(0, 0) else a
                for a in sched[0]]
    fails(sched, "stage 0, action 0", "only versions 0..0 exist")


def test_unapplied_gradients():
    sched = lists()
    sched[0] = [a for a in sched[0] if not isinstance(a, OptimizerStep)]
    fails(sched, "stage 0", "never applied")


def test_wrong_peer():
    sched = lists()
    i = sched[0].index(SendActivation(0, 1))
    sched[0][i] = SendActivation(0, 2)
    fails(sched, f"stage 0, action {i}", "not stage 0's neighbour")


def test_microbatch_order_differs_between_stages():
    s0 = [Forward(0, 0), Forward(1, 0), SendActivation(1, 1), SendActivation(0, 1), RecvGrad(0, 1),
          Backward(0, 0), RecvGrad(1, 1), Backward(1, 0), OptimizerStep(0)]
    s1 = [RecvActivation(0, 0), Forward(0, 0), RecvActivation(1, 0), Forward(1, 0), Backward(0, 0),
          SendGrad(0, 0), Backward(1, 0), SendGrad(1, 0), OptimizerStep(0)]
    fails([s0, s1], "stage 0, action 2", "matched by stage 1, action 0", "different order")


def rendezvous_cycle():
    """Both stages first wait for the other: fine if each run is posted as a batch,
    a deadlock with one blocking send/recv at a time."""
    s0 = [Forward(0, 0), SendActivation(0, 1), Forward(1, 0), RecvGrad(0, 1), SendActivation(1, 1),
          Backward(0, 0), RecvGrad(1, 1), Backward(1, 0), OptimizerStep(0)]
    s1 = [RecvActivation(0, 0), Forward(0, 0), Backward(0, 0), RecvActivation(1, 0), SendGrad(0, 0),
          Forward(1, 0), Backward(1, 0), SendGrad(1, 0), OptimizerStep(0)]
    return [s0, s1]


def test_deadlock_detected_with_blocking_p2p():
    message = fails(rendezvous_cycle(), "stage 0, action 3", "deadlock", "stage 1 waits at action 3")
    assert "RecvActivation(microbatch=1, peer=0)" in message


def test_same_lists_run_when_runs_are_batched():
    validate(rendezvous_cycle(), mode="batched")


def test_report_definitions_on_a_hand_made_list():
    # one stage, two steps, batch 1 uses the older version 0 (2BW rule, p=1)
    sched = [[Forward(0, 0), Backward(0, 0), OptimizerStep(0), Forward(1, 0), Forward(2, 1),
              Backward(1, 0), Backward(2, 1), OptimizerStep(1)]]
    r = validate(sched)
    assert r.max_weight_versions == [2]  # after step 0: version 1 (newest) and 0 (pending forward)
    assert r.max_inflight_microbatches == [2]
    assert r.delay_sets == [[0, 1]] and r.delay_per_stage == [1]
    assert r.num_steps == 2 and r.num_microbatches == 3

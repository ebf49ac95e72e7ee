"""Combined forward-backward steps (actions.ForwardBackward) in the action lists.

- 2bw's lists for Megatron's --overlap-moe-expert-parallel-comm (gen_2bw_paired): the
  validator accepts them for several (p, m) with m >= 2p-1, with two weight versions and
  2bw's one-step delay; the generator refuses m < 2p-1 naming the flags, and the bound is
  tight (the same lists at m = 2p-2 use a version before it exists). Each stage runs
  2(p-1-s)+1 forwards before its first combined step.
- Negative controls on hand-broken paired lists: a send held back past the next combined
  step deadlocks; a combined step on an older version needs a third weight version, which
  the validator refuses once told the runtime keeps two; a step pairing a microbatch with
  itself is refused.
- Megatron's interleaved 1F1B with the flag: one more warm-up forward than without it, no
  combined step on a stage whose warm-up covers the batch, and its lists validate.
- The registry gives 2bw's and interleaved 1F1B's paired generators for the flag, and names
  the flag for a schedule that has none; the stream of paired lists equals the generator's.
"""

import dataclasses

import pytest

from megatron_async.schedules.actions import (Backward, Forward, ForwardBackward, RecvActivation, ScheduleError,
                                              SendActivation, passes)
from megatron_async.schedules.gen_2bw_paired import (min_microbatches_2bw_paired, paired_2bw, two_bw_paired,
                                                     warmup_2bw_paired)
from megatron_async.schedules.gen_interleaved import interleaved_1f1b, interleaved_1f1b_paired
from megatron_async.schedules.registry import get_schedule_generator
from megatron_async.schedules.stream_2bw import TEMPLATE_BATCHES, TwoBWStream, shift
from megatron_async.schedules.validator import validate

SHAPES = [(p, m) for p in (2, 3, 4, 6) for m in sorted({2 * p - 1, 2 * p, 3 * p + 1})]


def _warmup(actions) -> int:
    """Forwards a stage runs before its first combined step or backward."""
    count = 0
    for a in actions:
        if isinstance(a, (ForwardBackward, Backward)):
            return count
        count += isinstance(a, Forward)
    return count


@pytest.mark.parametrize("p, m", SHAPES)
def test_the_validator_accepts_the_paired_2bw_lists(p, m):
    lists = two_bw_paired(p, m, 3)
    report = validate(lists, weight_versions=2)
    assert report.max_weight_versions == [2] * p
    assert report.delay_per_stage == [1] * p
    assert any(isinstance(a, ForwardBackward) for acts in lists for a in acts)
    assert [_warmup(acts) for acts in lists] == [min(warmup_2bw_paired(p, s), 3 * m) for s in range(p)]
    for acts in lists:  # 2bw's version rule, in both passes of every step
        for a in acts:
            for pass_ in passes(a):
                assert pass_.version == max(pass_.microbatch // m - 1, 0), a


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_fewer_than_2p_minus_1_microbatches_are_refused_naming_the_flags(p):
    m = min_microbatches_2bw_paired(p) - 1
    with pytest.raises(ValueError) as err:
        two_bw_paired(p, m, 2)
    for flag in ("--overlap-moe-expert-parallel-comm", "--global-batch-size", "--micro-batch-size",
                 "--pipeline-model-parallel-size"):
        assert flag in str(err.value)
    # tight: the same lists one microbatch short need a version before it exists
    with pytest.raises(ScheduleError, match="only versions"):
        validate(paired_2bw(p, m, 3, lambda s: warmup_2bw_paired(p, s)))
    validate(two_bw_paired(p, m + 1, 3), weight_versions=2)


def _moved_past_next_step(actions, index):
    """`actions` with the action at `index` moved to just after the next combined step."""
    moved = list(actions)
    action = moved.pop(index)
    step = next(i for i in range(index, len(moved)) if isinstance(moved[i], ForwardBackward))
    moved.insert(step + 1, action)
    return moved


def test_a_send_held_past_the_next_combined_step_deadlocks():
    """Stage 0 sends its last warm-up activation only after its first combined step, which
    waits for gradient 0: the stages downstream give it only after steps that need that
    activation."""
    p, m = 4, 8
    lists = [list(acts) for acts in two_bw_paired(p, m, 2)]
    last_warmup = warmup_2bw_paired(p, 0) - 1
    index = lists[0].index(SendActivation(last_warmup, 1))
    lists[0] = _moved_past_next_step(lists[0], index)
    with pytest.raises(ScheduleError, match="deadlock"):
        validate(lists)


def test_a_step_on_an_older_version_needs_a_third_version():
    """A combined step of batch 2 on version 0 (2bw's rule gives 1) keeps version 0 alive
    past step 1: three versions at once. The validator reports it, and refuses it when told
    the runtime keeps two."""
    p, m = 4, 8
    lists = [list(acts) for acts in two_bw_paired(p, m, 4)]
    i, step = next((i, a) for i, a in enumerate(lists[0])
                   if isinstance(a, ForwardBackward) and a.backward.microbatch // m == 2)
    old = dataclasses.replace(step.backward, version=0)
    lists[0][i] = ForwardBackward(step.forward, old)
    j = next(j for j, a in enumerate(lists[0]) if isinstance(a, Forward) and a.microbatch == old.microbatch
             or isinstance(a, ForwardBackward) and a.forward.microbatch == old.microbatch)
    stepped = lists[0][j]
    lists[0][j] = (dataclasses.replace(stepped, version=0) if isinstance(stepped, Forward)
                   else ForwardBackward(dataclasses.replace(stepped.forward, version=0), stepped.backward))
    assert validate(lists).max_weight_versions[0] == 3
    with pytest.raises(ScheduleError, match=r"needs 3 weight versions at once .*the runtime keeps 2"):
        validate(lists, weight_versions=2)
    validate(two_bw_paired(p, m, 4), weight_versions=2)  # the generator's own lists pass


def test_a_step_pairing_a_microbatch_with_itself_is_refused():
    lists = [[Forward(0, 0), ForwardBackward(Forward(1, 0), Backward(1, 0)), Backward(0, 0)]]
    with pytest.raises(ScheduleError, match="two different microbatches"):
        validate(lists)


@pytest.mark.parametrize("p, m", [(2, 4), (4, 4), (4, 8), (4, 16)])
def test_interleaved_with_the_flag_adds_one_warmup_forward(p, m):
    """Megatron's warm-up with two pieces a stage, (p-s-1)*2 + p, plus one with the flag; all
    passes of a batch in the warm-up (m = p) leave no combined step. A combined step holds
    one microbatch more in flight than the plain schedule's forward-then-backward."""
    plain, paired = interleaved_1f1b(p, m, 2), interleaved_1f1b_paired(p, m, 2)
    report, plain_report = validate(paired), validate(plain)
    for s in range(p):
        warmup = (p - s - 1) * 2 + p + 1
        assert _warmup(paired[s]) == min(warmup, 2 * m)
        steps = warmup < 2 * m
        assert any(isinstance(a, ForwardBackward) for a in paired[s]) == steps
        assert report.max_inflight_microbatches[s] == plain_report.max_inflight_microbatches[s] + steps


def test_the_registry_gives_the_paired_lists_for_the_flag():
    assert get_schedule_generator("2bw", ep_overlap=True) is two_bw_paired
    assert get_schedule_generator("interleaved-1f1b", ep_overlap=True) is interleaved_1f1b_paired
    with pytest.raises(ValueError, match="--overlap-moe-expert-parallel-comm"):
        get_schedule_generator("1f1b", ep_overlap=True)


@pytest.mark.parametrize("p, m", [(2, 3), (4, 7), (4, 9)])
def test_the_paired_stream_equals_the_generators_lists(p, m):
    for n in (1, 2, TEMPLATE_BATCHES, TEMPLATE_BATCHES + 2):
        full = two_bw_paired(p, m, n)
        for first in (0, 3):
            assert TwoBWStream(p, m, n, first, paired=True).lists() == [shift(a, first, m) for a in full]
    assert TwoBWStream(p, m, 4, paired=True).lists() != TwoBWStream(p, m, 4).lists()


def test_the_paired_lists_receive_both_inputs_before_a_step_and_send_after_it():
    """A combined step's forward input and backward gradient arrive before it; its activation
    and gradient leave after it (the stage in the middle of a 4-stage pipeline)."""
    lists = two_bw_paired(4, 8, 2)
    acts = lists[1]
    i = next(i for i, a in enumerate(acts) if isinstance(a, ForwardBackward))
    step = acts[i]
    before, after = acts[:i], acts[i + 1:]
    assert RecvActivation(step.forward.microbatch, 0) in before
    assert any(getattr(a, "microbatch", None) == step.backward.microbatch and type(a).__name__ == "RecvGrad"
               for a in before)
    assert SendActivation(step.forward.microbatch, 2) in after
    assert any(getattr(a, "microbatch", None) == step.backward.microbatch and type(a).__name__ == "SendGrad"
               for a in after)

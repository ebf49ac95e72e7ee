"""Schedule generators: version rules, step placement, bounds, and that all validate."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_async.schedules import gen_2bw
from megatron_async.schedules.actions import Backward, Forward, OptimizerStep
from megatron_async.schedules import generators
from megatron_async.schedules.generators import generate, min_microbatches_2bw, pipedream_versions
from megatron_async.schedules.registry import available_schedules, get_schedule, get_schedule_generator
from megatron_async.schedules.validator import ScheduleError, validate

SIZES = [(1, 1, 1), (2, 2, 3), (3, 4, 2), (4, 4, 3), (4, 7, 2), (6, 6, 4)]


def compute_only(stage_actions):
    return [a for a in stage_actions if isinstance(a, (Forward, Backward, OptimizerStep))]


@pytest.mark.parametrize("name, function", [("gpipe", "gpipe"), ("1f1b", "one_f_one_b_flush"), ("2bw", "two_bw"),
                                            ("pipedream", "pipedream")])
def test_registry_returns_generators(name, function):
    assert get_schedule_generator(name) is getattr(generators, function)
    assert len(generate(name, 3, 3, 2)) == 3


def test_registry_flags():
    assert get_schedule("2bw").requires_pipeline and get_schedule("2bw").weight_versions == 2
    assert get_schedule("gpipe").weight_versions == 1 and get_schedule("1f1b").run is None


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m,n", SIZES)
def test_flush_schedules_use_current_version_and_step_per_batch(name, p, m, n):
    for acts in generate(name, p, m, n):
        comp = compute_only(acts)
        for a in comp:
            if isinstance(a, (Forward, Backward)):
                assert a.version == a.microbatch // m
        steps = [i for i, a in enumerate(comp) if isinstance(a, OptimizerStep)]
        assert [comp[i].step for i in steps] == list(range(n))
        for b, i in enumerate(steps):  # flush: the step follows the batch's last backward, before batch b+1
            assert comp[i - 1] == Backward((b + 1) * m - 1, b)
            assert all(a.microbatch >= (b + 1) * m for a in comp[i + 1:] if not isinstance(a, OptimizerStep))


@pytest.mark.parametrize("p,m,n", [s for s in SIZES if s[1] >= s[0] - 1])
def test_2bw_version_rule_and_no_flush(p, m, n):
    for s, acts in enumerate(generate("2bw", p, m, n)):
        comp = compute_only(acts)
        for a in comp:
            if isinstance(a, (Forward, Backward)):
                assert a.version == max(a.microbatch // m - 1, 0)
        # warm-up of p-1-s forwards only at the start, then strict 1F1B across batches
        fb = [a for a in comp if not isinstance(a, OptimizerStep)]
        warm = min(p - 1 - s, n * m)
        assert all(isinstance(a, Forward) for a in fb[:warm])
        steady = fb[warm:len(fb) - warm]
        assert all(isinstance(a, Forward if i % 2 == 0 else Backward) for i, a in enumerate(steady))
        for i, a in enumerate(comp):
            if isinstance(a, OptimizerStep):
                assert comp[i - 1] == Backward((a.step + 1) * m - 1, max(a.step - 1, 0))


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_2bw_bound_on_microbatches(p):
    bound = p - 1
    assert min_microbatches_2bw(p) == bound
    report = validate(generate("2bw", p, bound, 3))
    assert max(report.max_weight_versions) == 2
    if bound - 1 >= 1:
        with pytest.raises(ValueError) as err:
            generate("2bw", p, bound - 1, 3)
        assert f"p-1 = {bound}" in str(err.value) and "--global-batch-size" in str(err.value)


@pytest.mark.parametrize("p", [3, 4, 8])
def test_2bw_bound_is_tight(monkeypatch, p):
    """With the refusal lifted, m = p-2 breaks the version rule: the validator says why."""
    monkeypatch.setattr(gen_2bw, "min_microbatches_2bw", lambda p: 1)
    with pytest.raises(ScheduleError, match=r"stage 0, action \d+ .*only versions"):
        validate(gen_2bw.two_bw(p, p - 2, 3))


@pytest.mark.parametrize("p,m,n", [(2, 2, 3), (4, 4, 3), (4, 3, 2), (8, 8, 2), (5, 9, 4)])
def test_2bw_delay_one_and_two_versions(p, m, n):
    r = validate(generate("2bw", p, m, n))
    assert r.delay_per_stage == [1] * p
    assert r.delay_sets == [[0, 1]] * p  # batch 0: delay 0, later batches: 1
    assert r.max_weight_versions == [2] * p
    assert r.max_inflight_microbatches == [min(p - s, n * m) for s in range(p)]


@pytest.mark.parametrize("p,m,n", [(2, 2, 2), (4, 4, 3), (4, 1, 7), (8, 8, 2)])
def test_pipedream_depth_dependent_delay(p, m, n):
    sched = generate("pipedream", p, m, n)
    r = validate(sched)
    assert r.delay_per_stage == [p - 1 - s for s in range(p)]
    assert r.max_weight_versions == pipedream_versions(p) == [p - s for s in range(p)]
    assert r.num_steps == n * m
    for s, acts in enumerate(sched):  # weight stashing: forward k at stage s uses version k-(p-1-s)
        for a in acts:
            if isinstance(a, Forward):
                assert a.version == max(a.microbatch - (p - 1 - s), 0)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_flush_schedules_have_no_delay(name):
    r = validate(generate(name, 4, 4, 3))
    assert r.delay_per_stage == [0] * 4 and r.max_weight_versions == [1] * 4


@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_every_generated_schedule_validates(data):
    p = data.draw(st.integers(1, 16), label="p")
    m = data.draw(st.integers(p, 4 * p), label="m")
    n = data.draw(st.integers(1, 4), label="n")
    for name in [n for n in available_schedules() if get_schedule(n).generator]:
        if name == "interleaved-1f1b" and m % p:
            continue  # Megatron's order groups p microbatches (tests/test_zero_bubble_schedules.py)
        report = validate(generate(name, p, m, n))
        assert report.num_microbatches == n * m


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "2bw", "pipedream"])
def test_lists_also_deadlock_free_when_runs_are_batched(name):
    validate(generate(name, 5, 6, 3), mode="batched")

"""With --overlap-moe-expert-parallel-comm under 2bw, Megatron's combined step calls the
forward step with return_schedule_plan=True. A custom forward step without that parameter
is refused in one line naming the flag where the 2bw runner starts, before any pass runs
(else a TypeError inside the first pass). Control: forward steps that take it (by name, or
through **kwargs) are accepted, and so is any forward step without the flag."""

from types import SimpleNamespace

import pytest

from megatron_async.megatron_lm.adapter.combined_step_flags import FLAG, check_forward_step
from megatron_async.megatron_lm.safety.failures import FlagError, our_line


def plain_forward_step(data_iterator, model):
    raise AssertionError("no pass may run")


def planned_forward_step(data_iterator, model, return_schedule_plan: bool = False):
    raise AssertionError("no pass may run")


def keyword_forward_step(data_iterator, model, **kwargs):
    raise AssertionError("no pass may run")


def test_a_forward_step_without_return_schedule_plan_is_refused_in_one_line_naming_the_flag():
    with pytest.raises(FlagError) as err:
        check_forward_step(plain_forward_step)
    line, code = our_line(err.value)
    assert line.startswith("megatron-async: error: ") and "\n" not in line and code == 2
    assert FLAG in line and "plain_forward_step" in line and "return_schedule_plan" in line


@pytest.mark.parametrize("forward_step", [planned_forward_step, keyword_forward_step])
def test_a_forward_step_taking_return_schedule_plan_is_accepted(forward_step):
    check_forward_step(forward_step)


class _Started(Exception):
    """What the stand-in run raises once the runner's start goes past the check."""


def _start(combined_steps: bool, forward_step):
    """TwoBWRun._start on a stand-in run whose first step past the check is loading the checkpoint."""
    from megatron_async.megatron_lm.adapter.two_bw_run import TwoBWRun

    def started(_args):
        raise _Started

    run = SimpleNamespace(args=SimpleNamespace(), combined_steps=combined_steps, start_from_checkpoint=started)
    TwoBWRun._start(run, SimpleNamespace(config=SimpleNamespace()), forward_step)


def test_the_runner_refuses_it_before_it_starts():
    with pytest.raises(FlagError, match="--overlap-moe-expert-parallel-comm"):
        _start(True, plain_forward_step)


@pytest.mark.parametrize("combined_steps,forward_step", [(True, planned_forward_step), (False, plain_forward_step)])
def test_control_the_runner_goes_on_to_start(combined_steps, forward_step):
    with pytest.raises(_Started):
        _start(combined_steps, forward_step)

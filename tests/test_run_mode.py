"""The run's mode is decided once (megatron_lm/adapter/run_mode.py): validation resolves it
from the three flags that say it, and every site asks the mode. Controls: each mode's
stash and run class differ, and the source check finds a flag read where one is planted."""

import argparse
import re
from pathlib import Path

import pytest

from megatron_async.megatron_lm.adapter import run_mode
from megatron_async.megatron_lm.safety.failures import FlagError

PACKAGE = Path(__file__).resolve().parent.parent / "megatron_async"
# the reads of the flags that say how a run trains, outside the module that resolves them
FLAG_READ = re.compile(r"\bargs\.(pipeline_schedule|simulated_delay|simulated_pipeline_stages)\b"
                       r"|getattr\(\w*args, \"(pipeline_schedule|simulated_delay)\"")


def _args(**over):
    return argparse.Namespace(**{"pipeline_schedule": None, "simulated_delay": (0,),
                                 "simulated_pipeline_stages": None, "delay_correction": "none",
                                 "exit_signal_handler": False, "exit_duration_in_mins": None, **over})


def test_each_mode_says_its_stash_and_its_run():
    sync = run_mode.resolve(_args())
    two_bw = run_mode.resolve(_args(pipeline_schedule="2bw"))
    simulated = run_mode.resolve(_args(simulated_delay=(1, 3), simulated_pipeline_stages=2))
    predict = run_mode.resolve(_args(pipeline_schedule="2bw", delay_correction="predict"))
    assert (sync.delayed, sync.stash_copies, sync.run_class()) == (False, 0, None)
    assert (two_bw.name, two_bw.stash_depth, two_bw.stash_copies) == ("2bw", 1, 1)
    assert two_bw.run_class().__name__ == "TwoBWRun"
    assert simulated.simulated and simulated.run_class().__name__ == "SimulatedDelayRun"
    assert (simulated.simulated_delay, simulated.stage_delays, simulated.stash_depth) == (3, (1, 3), 3)
    assert (predict.stash_depth, predict.stash_copies) == (1, 2)
    # a delay simulated under Megatron's named schedule is still the simulated delay, never synchronous
    assert run_mode.resolve(_args(pipeline_schedule="no-pipelining", simulated_delay=(1,))).simulated
    assert not run_mode.resolve(_args(pipeline_schedule="2bw")).agreed_stop
    assert run_mode.resolve(_args(pipeline_schedule="2bw", exit_duration_in_mins=5)).agreed_stop
    assert not run_mode.resolve(_args(exit_duration_in_mins=5)).agreed_stop  # Megatron's own stop


def test_an_unregistered_schedule_is_refused_naming_the_flag():
    with pytest.raises(FlagError, match="--pipeline-schedule 'nope' is not registered"):
        run_mode.resolve(_args(pipeline_schedule="nope"))


def test_the_held_mode_is_the_one_every_site_reads():
    args = _args(pipeline_schedule="2bw")
    held = run_mode.hold(args, run_mode.resolve(args))
    args.pipeline_schedule = None  # a later change of the flag does not change the run
    assert run_mode.of(args) is held


def _flag_reads(root: Path) -> list[str]:
    return [f"{path.relative_to(root.parent)}:{n}" for path in sorted(root.rglob("*.py"))
            if path.name != "run_mode.py" and path.parent.name != "schedules"
            for n, line in enumerate(path.read_text().splitlines(), 1) if FLAG_READ.search(line)]


def test_nothing_but_the_mode_reads_the_flags_that_say_how_a_run_trains(tmp_path):
    assert _flag_reads(PACKAGE) == []
    planted = tmp_path / "megatron_async" / "site.py"  # control: one read, found
    planted.parent.mkdir()
    planted.write_text("depth = args.simulated_delay\n")
    assert _flag_reads(planted.parent) == ["megatron_async/site.py:1"]


def _optional_parts(cls) -> list[str]:
    """The class attributes of a run class (and its bases) left None for a subclass to fill."""
    return sorted(name for klass in cls.__mro__ for name, value in vars(klass).items()
                  if value is None and not name.startswith("__"))


def test_runs_offer_capabilities_not_fields_left_none():
    """A hook asks a run to do something (its method's default is Megatron's own behaviour);
    no run class declares a part as None for the hooks to probe. Control: a class that does is named."""
    from megatron_async.megatron_lm.adapter.runtime import DelayedRun
    from megatron_async.megatron_lm.adapter.simulated_delay_run import SimulatedDelayRun
    from megatron_async.megatron_lm.adapter.two_bw_run import TwoBWRun

    assert [_optional_parts(cls) for cls in (DelayedRun, TwoBWRun, SimulatedDelayRun)] == [[], [], []]

    class Probed(DelayedRun):
        runner = None

    assert _optional_parts(Probed) == ["runner"]

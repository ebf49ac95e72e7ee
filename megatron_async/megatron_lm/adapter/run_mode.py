"""How a run trains, decided once when its flags are validated: its RunMode.

Three flags say it (`--pipeline-schedule`, `--simulated-delay` with
`--simulated-pipeline-stages`, and `--delay-correction predict`, which stashes two
predictions). `resolve` reads them once, before Megatron's validate_args, and `hold`
keeps the result on Megatron's args beside the run (plugin_run.py): the flag checks,
the save-space check, the checkpoint marker, the planner, the hooks and the runs ask the
mode, never the flags. The simulated delay is a mode like a schedule, with a spec of its
own (SIMULATED_DELAY): Megatron's schedule run at older weights by SimulatedDelayRun.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_async.megatron_lm.safety.failures import FlagError
from megatron_async.schedules.registry import MEGATRON_DEFAULT, ScheduleSpec, available_schedules, schedule_or_default
from megatron_async.stash.delay_reference import parse_delays

MODE_ATTR = "megatron_async_mode"

SIMULATED_DELAY = ScheduleSpec(
    name="simulated-delay",
    description="--simulated-delay K: Megatron's own schedule at the weights of K steps ago (PP=1), the "
                "reference a delayed schedule must equal",
    run="megatron_async.megatron_lm.adapter.simulated_delay_run:SimulatedDelayRun",
)


@dataclass(frozen=True)
class RunMode:
    """The spec of what trains the run (the named schedule's, MEGATRON_DEFAULT for Megatron's own
    choice, SIMULATED_DELAY under --simulated-delay), the schedule named with --pipeline-schedule,
    the simulated stages' delays, and what follows from them."""

    spec: ScheduleSpec = MEGATRON_DEFAULT
    schedule: ScheduleSpec = MEGATRON_DEFAULT  # --pipeline-schedule's (MEGATRON_DEFAULT: none given)
    delays: tuple = (0,)  # --simulated-delay: one delay, or one per would-be stage
    simulated_stages: int = 1  # --simulated-pipeline-stages: the would-be stages clipped apart
    predict: bool = False  # --delay-correction predict: the stash holds two predictions
    agreed_stop: bool = False  # every rank stops at one agreed iteration (pipeline/stop_agreement.py)
    # Megatron's --overlap-moe-expert-parallel-comm under a schedule of our runtime: the runtime runs
    # the schedule's combined forward-backward lists through Megatron's combined step (2bw's checks
    # refuse it where the schedule has no such lists)
    combined_steps: bool = False

    def __reduce__(self):
        # Megatron pickles its args into every checkpoint; a mode is the run's, not the checkpoint's,
        # and torch's weights-only loader rebuilds an empty set without importing our code
        return (set, ())

    @property
    def name(self) -> Optional[str]:
        """The schedule named with --pipeline-schedule (None: none)."""
        return None if self.schedule is MEGATRON_DEFAULT else self.schedule.name

    @property
    def simulated(self) -> bool:
        return self.spec is SIMULATED_DELAY

    @property
    def delayed(self) -> bool:
        """A delayed mode of ours trains this run (2bw, the simulated delay)."""
        return self.spec.run is not None

    @property
    def simulated_delay(self) -> int:
        """The longest simulated delay (0: none), as the checkpoint marker records it."""
        return max(self.delays) if self.simulated else 0

    @property
    def stage_delays(self) -> Optional[tuple]:
        """Each would-be stage's own simulated delay, where they differ (None: one for all)."""
        return self.delays if self.simulated and len(set(self.delays)) > 1 else None

    @property
    def stash_depth(self) -> int:
        """Weight versions kept behind the live ones: the schedule's, or the simulated delay."""
        return self.simulated_delay if self.simulated else self.spec.stash_copies

    @property
    def stash_copies(self) -> int:
        """Copies of the weights the stash holds (two predictions with weight prediction)."""
        return 2 if self.predict and self.stash_depth else self.stash_depth

    def run_class(self):
        """The class that trains this mode in Megatron's loop (None: a synchronous run)."""
        return self.spec.run_class()


def resolve(args) -> RunMode:
    """The mode of Megatron's parsed (not yet validated) args; raises FlagError for a
    schedule that is not registered (flags.py checks the rest, naming the flag)."""
    name = getattr(args, "pipeline_schedule", None)
    if name is not None and name not in available_schedules():
        raise FlagError(f"--pipeline-schedule {name!r} is not registered; choose one of: "
                        f"{', '.join(available_schedules())}")
    raw = getattr(args, "simulated_delay", (0,))
    delays = tuple(raw) if isinstance(raw, (tuple, list)) else parse_delays(str(raw))
    stages = getattr(args, "simulated_pipeline_stages", None)
    if stages is None:
        stages = len(delays) if len(delays) > 1 else 1
    schedule = schedule_or_default(name)
    # a delay simulated under one of Megatron's schedules (flags.py refuses it beside a delayed one)
    spec = SIMULATED_DELAY if max(delays) > 0 and schedule.run is None else schedule
    agreed_stop = spec.runtime is not None and bool(
        getattr(args, "exit_signal_handler", False) or getattr(args, "exit_duration_in_mins", None))
    combined_steps = spec.runtime is not None and bool(getattr(args, "overlap_moe_expert_parallel_comm", False))
    return RunMode(spec=spec, schedule=schedule, delays=delays, simulated_stages=stages,
                   predict=getattr(args, "delay_correction", "none") == "predict", agreed_stop=agreed_stop,
                   combined_steps=combined_steps)


def hold(args, mode: RunMode) -> RunMode:
    setattr(args, MODE_ATTR, mode)
    return mode


def of(args) -> RunMode:
    """The mode validation resolved for `args`; resolved now for args that never went through
    validation (a checkpoint's saved args, a planner's or a test's namespace)."""
    mode = getattr(args, MODE_ATTR, None)
    return mode if isinstance(mode, RunMode) else resolve(args)

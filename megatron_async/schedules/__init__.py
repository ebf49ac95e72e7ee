"""Pipeline schedules: registry, action lists, validator and simulator."""

from megatron_async.schedules.registry import (  # noqa: F401
    ScheduleSpec,
    available_schedules,
    get_forward_backward_func,
    get_schedule,
    get_schedule_generator,
    register_schedule,
)

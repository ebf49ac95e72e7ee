"""Runtime for asynchronous pipeline schedules: executor, point-to-point links, stage-local gradient statistics."""

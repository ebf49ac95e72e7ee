"""megatron_async: asynchronous (PipeDream-2BW) pipeline pretraining for Megatron-Core."""

__version__ = "0.1.0"

import sys as _sys

# A worker's spawned child (the checkpoint writer's Manager) imports the worker's main
# module while multiprocessing prepares it, hence this package, whatever the entry; it
# is named after its Process there ("MainProcess" is every other interpreter's name).
if "multiprocessing" in _sys.modules and _sys.modules["multiprocessing"].current_process().name != "MainProcess":
    from megatron_async.megatron_lm.safety.launcher_watch import exit_with_parent as _exit_with_parent

    _exit_with_parent()

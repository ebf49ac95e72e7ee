"""What a delayed run changes in Megatron for as long as it needs it, as one table
(megatron_async/patch_table.py).

Installed by the run that needs it, never by a synchronous one: the stale global norm
only for the length of one optimizer step (pipeline/stale_global.py), the stage-local
statistics on the layer-wise optimizer one 2bw run built and the would-be stages' norm
groups before a --simulated-delay run's optimizer is built (pipeline/grad_stats.py), and
Megatron's --exit-duration-in-mins kept by the stop agreement until it settles
(pipeline/stop_agreement.py). Each module declares its entries; a run's values (the
norm's state, the stage count) are bound to an entry with `patch_table.bound`, its
objects (the optimizer, Megatron's arguments) given to the installer.
"""

from __future__ import annotations

from megatron_async.pipeline.grad_stats import STAGE_LOCAL_STATISTICS, STAGE_NORM_GROUPS
from megatron_async.pipeline.stale_global import STALE_GLOBAL_NORM
from megatron_async.pipeline.stop_agreement import MEGATRON_DURATION

DELAYED_RUN_PATCHES = (STALE_GLOBAL_NORM, STAGE_LOCAL_STATISTICS, STAGE_NORM_GROUPS, MEGATRON_DURATION)

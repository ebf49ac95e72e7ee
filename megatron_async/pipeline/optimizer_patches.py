"""What delayed runs change in Megatron's optimizer, as one table (megatron_async/patch_table.py).

Installed by the run that needs it, never by a synchronous one: the stale global norm
only for the length of one optimizer step (pipeline/stale_global.py), the stage-local
statistics on the layer-wise optimizer one 2bw run built and the would-be stages' norm
groups before a --simulated-delay run's optimizer is built (pipeline/grad_stats.py). Each
module declares its entries; a run's values (the norm's state, the stage count) are bound
to an entry with `patch_table.bound`.
"""

from __future__ import annotations

from megatron_async.pipeline.grad_stats import STAGE_LOCAL_STATISTICS, STAGE_NORM_GROUPS
from megatron_async.pipeline.stale_global import STALE_GLOBAL_NORM

OPTIMIZER_PATCHES = (STALE_GLOBAL_NORM, STAGE_LOCAL_STATISTICS, STAGE_NORM_GROUPS)

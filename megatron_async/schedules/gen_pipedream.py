"""Original PipeDream: an update after every microbatch, weight stashing.

For the constant-vs-variable delay ablation. Every microbatch is its own optimizer
step at every stage (m and n only fix how many microbatches run: n*m). Stage s runs
1F1B with p-1-s warm-up forwards and no flush; a forward uses the newest weights the
stage has, and its backward reuses them (stashing). The forward of microbatch k at
stage s follows the step of microbatch k-(p-1-s)-1, so it uses version
max(k-(p-1-s), 0) and its gradient, applied by step k to version k, is p-1-s steps
old: the delay depends on depth. Stage s keeps p-s versions (its p-1-s stashed
in-flight ones plus the newest).
"""

from __future__ import annotations

from megatron_async.schedules.actions import Action, Backward, Forward, OptimizerStep
from megatron_async.schedules.gen_common import add_communication, check_sizes, one_f_one_b


def pipedream_versions(num_stages: int) -> list[int]:
    """Weight versions stage s must hold once the run is long enough to reach the steady
    state (at least 2p-1 microbatches in all); shorter runs need fewer."""
    return [num_stages - s for s in range(num_stages)]


def pipedream(num_stages: int, microbatches: int, batches: int = 1) -> list[list[Action]]:
    check_sizes(num_stages, microbatches, batches)
    compute = []
    for s in range(num_stages):
        acts, newest, stash = [], 0, {}
        for kind, k in one_f_one_b(range(microbatches * batches), num_stages - 1 - s):
            if kind == "F":
                stash[k] = newest
                acts.append(Forward(k, newest))
            else:
                acts += [Backward(k, stash.pop(k)), OptimizerStep(k)]
                newest = k + 1
        compute.append(acts)
    return add_communication(compute)

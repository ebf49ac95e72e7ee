"""`--metrics-json`: one JSON line per iteration, next to Megatron's own logging.

Megatron's log line rounds the loss and TensorBoard needs a reader; a JSON line
per iteration (loss, learning rate, grad norm, seconds) is what plots, sweeps and
equivalence tests read. Written by the last rank (where Megatron prints), from
the values Megatron's training_log receives; nothing is communicated.
"""

from __future__ import annotations

import inspect
import os
import time

from megatron_async.training.metrics import json_line

_STATE = {"file": None, "last": None, "signature": None}


def _float(value):
    if value is None:
        return None
    return float(value.item() if hasattr(value, "item") else value)


def record_iteration(training_log, args, kwargs) -> None:
    import torch
    from megatron.training import get_args

    margs = get_args()
    if not margs.metrics_json or torch.distributed.get_rank() != torch.distributed.get_world_size() - 1:
        return
    if _STATE["signature"] is None:
        _STATE["signature"] = inspect.signature(training_log)
        os.makedirs(os.path.dirname(os.path.abspath(margs.metrics_json)), exist_ok=True)
        _STATE["file"] = open(margs.metrics_json, "a" if margs.iteration else "w", encoding="utf-8")
    bound = _STATE["signature"].bind(*args, **kwargs).arguments
    now = time.perf_counter()
    seconds = now - _STATE["last"] if _STATE["last"] is not None else None
    _STATE["last"] = now
    losses = {key.replace(" ", "_"): _float(value) for key, value in (bound["loss_dict"] or {}).items()}
    record = dict(iteration=bound["iteration"], **losses, lr=_float(bound["learning_rate"]),
                  grad_norm=_float(bound["grad_norm"]), skipped=bool(bound["skipped_iter"]), s_per_iter=seconds)
    _STATE["file"].write(json_line(record))
    _STATE["file"].flush()

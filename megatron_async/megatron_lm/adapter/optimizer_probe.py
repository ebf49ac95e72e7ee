"""Whether Megatron can build and step an emerging optimizer here, found out before training.

Megatron-Core 0.19.2 offers `--optimizer adaptive_muon`, but its adapter builds an
object that emerging-optimizers 0.3.0 cannot step (a missing `scale_mode`): the run
would fail at its first step, after minutes of start-up on a cluster. A one-step
probe on a 2x2 weight, through the function Megatron builds it with, finds out.
"""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def failure(name: str):
    """None when `--optimizer name` builds and steps, else the error as text."""
    if name in ("adam", "sgd"):
        return None
    from types import SimpleNamespace

    import torch
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.emerging_optimizers import _create_emerging_optimizer

    weight = torch.nn.Parameter(torch.ones(2, 2))
    weight.grad = torch.eye(2)
    chunk = SimpleNamespace(config=SimpleNamespace(num_attention_heads=1, num_query_groups=1, kv_channels=2))
    try:
        optimizer, _ = _create_emerging_optimizer(OptimizerConfig(optimizer=name, lr=1e-3), [{"params": [weight]}],
                                                  name, [chunk], None)
        optimizer.step()
    except Exception as err:  # noqa: BLE001 - any failure means "cannot train with it here"
        return f"{type(err).__name__}: {err}"
    return None

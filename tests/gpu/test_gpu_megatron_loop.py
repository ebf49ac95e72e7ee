"""A one-step delay in Megatron's own loop on a GPU (1 GPU; TE for the TE case).

`--simulated-delay 1` trains a GPT of 4 layers, hidden 256, in bf16 with Muon,
on mock data, under torchrun with NCCL: once with Transformer Engine layers and
gradient-accumulation fusion on (Megatron's default), once with Megatron's local
layers (a node without TE). The metrics file must hold a finite loss for every
iteration, and the loss of the last five iterations must be below that of the
first five. Megatron's own argument dump must show NCCL: the CPU emulation, which
switches to gloo, never runs where CUDA exists.
"""

import math
import re
import statistics

import pytest

from tests.support.gpu.gpt_flags import MUON, gpt_flags
from tests.support.gpu.launch import read_metrics, tail, torchrun_gpt, train_losses

ITERS = 40
TIMEOUT_S = 600


@pytest.mark.parametrize("impl", [pytest.param("transformer_engine", marks=pytest.mark.te), "local"])
@pytest.mark.timeout(TIMEOUT_S + 120)
def test_simulated_delay_trains_a_gpt_with_muon(impl, tmp_path, gpu_record):
    metrics = tmp_path / "delay.jsonl"
    proc = torchrun_gpt(gpt_flags(iters=ITERS, impl=impl) + MUON + ["--simulated-delay", 1,
                                                                    "--metrics-json", metrics], 1, TIMEOUT_S)
    assert proc.returncode == 0, tail(proc)
    # what Megatron ran with, from its own argument dump
    assert re.search(rf"transformer_impl \.+ {impl}\b", proc.stdout), tail(proc)
    assert re.search(r"distributed_backend \.+ nccl\b", proc.stdout), tail(proc)
    if impl == "transformer_engine":
        assert re.search(r"gradient_accumulation_fusion \.+ True", proc.stdout), tail(proc)
    losses = train_losses(read_metrics(metrics))
    gpu_record(impl=impl, losses=losses, wall_s=round(proc.wall_s, 1))
    assert len(losses) == ITERS, losses
    assert all(x is not None and math.isfinite(x) for x in losses), losses
    first, last = statistics.mean(losses[:5]), statistics.mean(losses[-5:])
    assert last < first, f"loss did not fall: first five {first:.4f}, last five {last:.4f}"

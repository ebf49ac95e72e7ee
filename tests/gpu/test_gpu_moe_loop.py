"""An MoE GPT under a one-step delay in Megatron's loop on one GPU, with its routing record.

`--simulated-delay 1` trains the suite's GPT with its MLPs replaced by MoE layers (4
experts, top-2, alltoall dispatcher, the aux loss at 1e-2; EP=1) in bf16 with Muon,
under torchrun with NCCL: with Megatron's local layers, and with TE's layers and
grouped GEMM where TE is present. Every iteration must have a finite loss, the loss
must fall, and the metrics file must hold a routing record per iteration: each
layer's load imbalance (max / mean tokens per expert) within [1, experts / top-k] and
an aux loss equal to the one Megatron prints (a record from the next iteration does
not match: the control).
"""

import math
import re
import statistics

import pytest

from tests.support.gpu.gpt_flags import MUON, gpt_flags
from tests.support.gpu.launch import read_metrics, tail, torchrun_gpt, train_losses
from tests.support.megatron_log import printed_aux_losses

ITERS = 30
TIMEOUT_S = 600
LAYERS, EXPERTS, TOPK = 4, 4, 2
MOE = ["--num-experts", EXPERTS, "--moe-router-topk", TOPK, "--moe-aux-loss-coeff", 1e-2, "--disable-bias-linear",
       "--moe-token-dispatcher-type", "alltoall"]


@pytest.mark.parametrize("impl", [pytest.param("transformer_engine", marks=pytest.mark.te), "local"])
@pytest.mark.timeout(TIMEOUT_S + 120)
def test_delayed_moe_trains_and_records_its_routing(impl, tmp_path, gpu_record):
    metrics = tmp_path / "moe.jsonl"
    grouped = ["--moe-grouped-gemm"] if impl == "transformer_engine" else []
    flags = gpt_flags(layers=LAYERS, iters=ITERS, impl=impl) + MUON + MOE + grouped + [
        "--simulated-delay", 1, "--metrics-json", metrics]
    proc = torchrun_gpt(flags, 1, TIMEOUT_S)
    assert proc.returncode == 0, tail(proc)
    assert re.search(r"distributed_backend \.+ nccl\b", proc.stdout), tail(proc)
    records = read_metrics(metrics)
    losses = train_losses(records)
    routing = [r for r in records if "moe_load_imbalance" in r]
    gpu_record(impl=impl, losses=losses, imbalance=[r["moe_load_imbalance"] for r in routing],
               aux=[r.get("moe_aux_loss") for r in routing], wall_s=round(proc.wall_s, 1))
    assert len(losses) == ITERS and all(x is not None and math.isfinite(x) for x in losses), losses
    first, last = statistics.mean(losses[:5]), statistics.mean(losses[-5:])
    assert last < first, f"loss did not fall: first five {first:.4f}, last five {last:.4f}"
    assert [r["iteration"] for r in routing] == list(range(1, ITERS + 1))
    for r in routing:
        assert len(r["moe_load_imbalance_layers"]) == LAYERS
        assert all(1.0 <= x <= EXPERTS / TOPK + 1e-9 for x in r["moe_load_imbalance_layers"]), r
    ours, printed = {r["iteration"]: r["moe_aux_loss"] for r in routing}, printed_aux_losses(proc.stdout)
    # Megatron's line for iteration 2 averages iterations 1 and 2; from 3 on, one iteration each
    checked = [it for it in sorted(printed) if it >= 3]
    assert checked, tail(proc)
    for it in checked:
        assert ours[it] == pytest.approx(printed[it], rel=1e-4), it
    assert any(ours[it] != pytest.approx(printed[it + 1], rel=1e-4) for it in checked[:-1])

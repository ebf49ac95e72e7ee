"""The routing record of an MoE model in `--metrics-json` (megatron_lm/observability/moe_routing).

- Tokens per expert: counted from each TopKRouter's routing map; the imbalance
  (max / mean per expert) equals one computed with numpy from the same assignments.
- In Megatron's loop: every training iteration gets a record for every layer; the
  aux loss equals what Megatron itself prints for the iteration (its log line,
  --log-interval 1, seven significant digits), and comparing against the neighbouring
  iteration fails (negative control).
- At PP=2 under 2bw the record holds the last stage's layers and null for the first's.
"""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_async.megatron_lm.observability import moe_routing
from tests.support.loop_runs import CPU, MODEL, TRAIN
from tests.support.megatron_log import printed_aux_losses
from tests.support.warm_launch import warm_run

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01", "--disable-bias-linear",
       "--moe-token-dispatcher-type", "alltoall"]


def _routing_map(rng, tokens, experts, topk):
    chosen = np.stack([rng.choice(experts, size=topk, replace=False, p=rng.dirichlet(np.ones(experts)))
                       for _ in range(tokens)])
    routing = np.zeros((tokens, experts), dtype=bool)
    np.put_along_axis(routing, chosen, True, axis=1)
    return routing, chosen


def test_imbalance_is_max_over_mean_tokens_per_expert():
    rng = np.random.default_rng(0)
    counts = moe_routing.RoutingCounts()
    counts.handles = [object()]  # as if attached to a model
    expected = {}
    for layer in (1, 2):
        chosen_all = []
        for _microbatch in range(3):
            routing, chosen = _routing_map(rng, 40, 8, 2)
            chosen_all.append(chosen.ravel())
            router = SimpleNamespace(training=True, layer_number=layer)
            counts.count(router, None, (None, torch.from_numpy(routing)))
        per_expert = np.bincount(np.concatenate(chosen_all), minlength=8)
        expected[layer] = per_expert.max() / per_expert.mean()
    # an evaluation forward is not counted
    counts.count(SimpleNamespace(training=False, layer_number=1), None,
                       (None, torch.ones(40, 8, dtype=torch.bool)))
    record = counts.take_record(7, num_layers=3, num_experts=8)
    assert record["iteration"] == 7
    assert record["moe_load_imbalance_layers"][:2] == pytest.approx([expected[1], expected[2]], rel=1e-12)
    assert record["moe_load_imbalance_layers"][2] is None  # a layer no router of this rank holds
    assert record["moe_load_imbalance"] == pytest.approx((expected[1] + expected[2]) / 2, rel=1e-12)
    assert counts.counts == {}  # the next iteration starts from zero


def _moe_run(tmp_path, name, nproc, extra):
    metrics = tmp_path / f"{name}.jsonl"
    proc = warm_run("megatron_async.launch", ["--gpt", *CPU, *MODEL, *TRAIN, *MOE, "--metrics-json", str(metrics),
                                              *extra], nproc, 300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return proc.stdout, [r for r in records if "moe_load_imbalance" in r]


def test_megatrons_loop_records_routing_and_megatrons_aux_loss(tmp_path):
    stdout, records = _moe_run(tmp_path, "moe", 1, [])
    iterations = [r["iteration"] for r in records]
    assert iterations == list(range(1, len(iterations) + 1)) and len(iterations) >= 8
    experts, topk = 4, 2
    for r in records:
        assert len(r["moe_load_imbalance_layers"]) == 4
        assert all(1.0 <= x <= experts / topk for x in r["moe_load_imbalance_layers"])
    printed = printed_aux_losses(stdout)
    assert sorted(printed) == iterations
    ours = {r["iteration"]: r["moe_aux_loss"] for r in records}
    # Megatron's line for iteration 2 averages iterations 1 and 2 (its accumulator is
    # not reset after the first line); from iteration 3 on each line is one iteration
    assert (ours[1] + ours[2]) / 2 == pytest.approx(printed[2], rel=1e-5)
    for it in iterations:
        if it != 2:
            assert ours[it] == pytest.approx(printed[it], rel=1e-5), it
    # negative control: the aux loss changes from one iteration to the next by more than the tolerance
    assert any(ours[it] != pytest.approx(printed[it + 1], rel=1e-5) for it in iterations[2:-1])


def test_2bw_records_the_last_stages_layers(tmp_path):
    _, records = _moe_run(tmp_path, "moe_2bw", 2, ["--pipeline-model-parallel-size", "2",
                                                   "--pipeline-schedule", "2bw"])
    assert records
    for r in records:
        first, last = r["moe_load_imbalance_layers"][:2], r["moe_load_imbalance_layers"][2:]
        assert first == [None, None] and all(x is not None and x >= 1.0 for x in last)
        assert r["moe_aux_loss_layers"][:2] == [None, None] and r["moe_aux_loss"] > 0

"""The split of whole layers that makes the slowest pipeline stage fastest (planning/balance.py).

- Optimal: on small cases with random per-layer costs and per-end extras, the split's
  slowest stage equals the best over every contiguous split (brute force).
- The SmolLM-360M shape of docs/benchmarks.md (32 layers, the output layer worth about
  four layers on the last stage, PP=4): 9, 9, 9 and 5 layers, within 1% of a perfect
  balance, where Megatron's even split is 36% above it.
- Megatron accepts the flags it prints, through its own argument validation with the
  plugin, at PP = 2, 4 and 8 under 2bw, with tied embeddings and with MTP; the negative
  control: flags that do not add up to --num-layers are refused.
- The cost model's terms each follow the flag that makes them (tied link, step share over
  m, Muon against Adam, expert all-to-all, an untied output layer's step, MTP).
"""

import itertools
import random

import pytest

from megatron_async.planning.balance import best_split, even_split, megatron_flags, stage_costs
from tests.support.refusals import check_in_one_process


def _compositions(total: int, parts: int):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0,) + cuts + (total,)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


@pytest.mark.parametrize("seed", range(12))
def test_the_split_is_optimal_against_brute_force(seed):
    rng = random.Random(seed)
    layers, stages = rng.randint(2, 10), rng.randint(1, 4)
    stages = min(stages, layers)
    costs = [rng.uniform(0.5, 2.0) for _ in range(layers)]
    first, last = rng.uniform(0, 3), rng.uniform(0, 6)
    split = best_split(costs, stages, first, last)
    brute = min(max(stage_costs(c, costs, first, last)) for c in _compositions(layers, stages))
    assert split.slowest == pytest.approx(brute)
    assert sum(split.layers) == layers and min(split.layers) >= 1
    restricted = best_split(costs, stages, first, last, first_and_last_only=True)
    expressible = [c for c in _compositions(layers, stages) if len(set(c[1:-1])) <= 1]
    assert restricted.slowest == pytest.approx(min(max(stage_costs(c, costs, first, last)) for c in expressible))


def test_smollm_360m_shape_balances_within_one_percent():
    costs, head = [1.0] * 32, 4.0  # the output layer: 35.2 - 23.5 ms against 23.5 / 8 ms a layer
    split = best_split(costs, 4, last_extra=head)
    assert split.layers == (9, 9, 9, 5) and split.imbalance < 0.01, split
    even = stage_costs(even_split(32, 4), costs, last_extra=head)
    assert max(even) / (sum(even) / 4) - 1 > 0.3
    assert megatron_flags(split.layers) == ["--decoder-last-pipeline-num-layers", "5"]


def test_flags_for_each_kind_of_split():
    assert megatron_flags((4, 4, 4)) == []
    assert megatron_flags((5, 3)) == ["--decoder-first-pipeline-num-layers", "5",
                                      "--decoder-last-pipeline-num-layers", "3"]
    assert megatron_flags((3, 4, 4, 2)) == ["--decoder-first-pipeline-num-layers", "3",
                                            "--decoder-last-pipeline-num-layers", "2"]
    assert megatron_flags((3, 4, 5, 2)) == ["--pipeline-model-parallel-layout", "Et*3|t*4|t*5|t*2L"]
    with pytest.raises(ValueError, match="--mtp-num-layers"):
        megatron_flags((3, 4, 5, 2), mtp=True)


BASE = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "4096", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--max-position-embeddings", "16",
        "--micro-batch-size", "1", "--train-iters", "2", "--eval-interval", "10", "--lr", "1e-3",
        "--pipeline-schedule", "2bw"]
MTP = ["--mtp-num-layers", "1", "--position-embedding-type", "rope"]


def _case(stages: int, layers: int, head: float, extra: list, mtp: bool = False):
    split = best_split([1.0] * layers, stages, last_extra=head, first_and_last_only=mtp)
    argv = BASE + ["--num-layers", str(layers), "--pipeline-model-parallel-size", str(stages),
                   "--global-batch-size", str(4 * stages)] + megatron_flags(split.layers, mtp) + extra
    return {"world": stages, "argv": argv}, split


def test_megatron_accepts_the_flags_it_prints(tmp_path):
    cases, splits = {}, {}
    for stages in (2, 4, 8):
        for name, extra, mtp in (("tied", [], False), ("MTP", MTP, True)):
            cases[f"PP={stages}, {name}"], splits[f"PP={stages}, {name}"] = _case(stages, 2 * stages + 3, 3.0,
                                                                                  extra, mtp)
    cases["PP=4, layout"], splits["PP=4, layout"] = _case(4, 21, 5.0, [])
    # negative control: the printed counts do not add up to --num-layers
    bad, _ = _case(4, 11, 3.0, [])
    bad["argv"][bad["argv"].index("--num-layers") + 1] = "12"
    cases["counts that do not add up"] = bad
    found = check_in_one_process(cases, tmp_path)
    for name in cases:
        if name == "counts that do not add up":
            assert found[name]["refused"], name
        else:
            assert not found[name]["refused"], (name, splits[name].layers, found[name]["error"])
    assert any("--decoder-last-pipeline-num-layers" in " ".join(c["argv"]) for c in cases.values())
    assert "--pipeline-model-parallel-layout" in cases["PP=4, layout"]["argv"], splits["PP=4, layout"]


def test_the_layers_each_stage_holds_under_megatrons_flags():
    from megatron_async.planning.balance import layers_per_stage

    assert layers_per_stage(12, 4) == [3, 3, 3, 3]
    assert layers_per_stage(11, 4, last=2) == [3, 3, 3, 2]
    assert layers_per_stage(10, 4, first=1, last=3) == [1, 3, 3, 3]
    assert layers_per_stage(11, 4, layout="Et*2|t*4|t*4|tL") == [2, 4, 4, 1]


SPLIT_ARGS = BASE + ["--num-layers", "11", "--pipeline-model-parallel-size", "4", "--global-batch-size", "16",
                     "--transformer-impl", "local", "--use-cpu-initialization"]
DELAY_ARGS = [a for a in BASE if a not in ("--pipeline-schedule", "2bw")] + [
    "--num-layers", "2", "--global-batch-size", "4", "--transformer-impl", "local", "--use-cpu-initialization"]
DELAYS = {"delay0": ([], 0), "delay1": (["--simulated-delay", "1"], 1), "delay2": (["--simulated-delay", "2"], 2)}


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """The plans these tests read, made in one planner process (tests/support/plans.py)."""
    import json
    from tests.support.warm_launch import warm_python

    out = tmp_path_factory.mktemp("plans")
    jobs = {"counts": (4, SPLIT_ARGS + megatron_flags((3, 3, 3, 2))),
            "layout": (4, SPLIT_ARGS + megatron_flags((2, 4, 4, 1))),
            **{name: (1, DELAY_ARGS + flags) for name, (flags, _) in DELAYS.items()}}
    (out / "jobs.json").write_text(json.dumps([{"world": world, "json": str(out / f"{name}.json"), "argv": argv}
                                               for name, (world, argv) in jobs.items()]))
    proc = warm_python("tests.support.plans", [str(out / "jobs.json")], 300)
    assert proc.returncode in (0, 1), proc.stdout[-6000:]
    return {name: json.loads((out / f"{name}.json").read_text())["stages"] for name in jobs}


def test_the_memory_plan_is_made_for_the_split_the_run_uses(plans):
    """megatron-async-plan under first/last counts and under a layout: each stage is built
    with its own layers (a stage between, with no embedding or output layer, holds
    parameters in proportion to its layers)."""
    counted, laid_out = plans["counts"], plans["layout"]
    assert [s["layers"] for s in counted] == [3, 3, 3, 2] and [s["layers"] for s in laid_out] == [2, 4, 4, 1]
    assert laid_out[1]["stage_params"] * 3 == counted[1]["stage_params"] * 4


def _args(**over):
    from types import SimpleNamespace

    base = dict(hidden_size=1024, padded_vocab_size=32768, tensor_model_parallel_size=1, data_parallel_size=4,
                micro_batch_size=2, seq_length=2048, global_batch_size=64, optimizer="muon",
                expert_model_parallel_size=1, num_experts=None, moe_router_topk=2, pipeline_model_parallel_size=4,
                untie_embeddings_and_output_weights=False, mtp_num_layers=None, num_layers=16)
    return SimpleNamespace(**{**base, **over})



def _layer():
    from megatron_async.planning.balance import LayerShape

    h, f = 1024, 4096
    return LayerShape(active_params=4 * h * h + 2 * h * f, matrices=((3 * h, h, False), (h, h, False), (f, h, False),
                                                                    (h, f, False)),
                      params=4 * h * h + 2 * h * f, expert_params=0)


def test_each_cost_term_follows_the_flag_that_makes_it():
    """The cost model's terms (planning/balance.cost_model): the tied link only with tied
    embeddings at PP > 1, on both ends; the step's share falls with more microbatches; Muon's
    Newton-Schulz costs more than Adam's pass over the state; the expert all-to-all only with
    expert parallelism; an untied output layer's step on the last stage."""
    from megatron_async.planning.balance import LayerShape, cost_model

    tied = cost_model(_args(), _layer())
    assert tied.terms["tied_link"] > 0 and tied.first_extra >= tied.terms["tied_link"]
    assert cost_model(_args(pipeline_model_parallel_size=1), _layer()).terms["tied_link"] == 0
    untied = cost_model(_args(untie_embeddings_and_output_weights=True), _layer())
    assert untied.terms["tied_link"] == 0 and untied.terms["output_layer_step"] > 0
    assert untied.last_extra - untied.terms["output_layer_step"] == pytest.approx(tied.last_extra - tied.terms["tied_link"])
    more_m = cost_model(_args(global_batch_size=256), _layer())
    assert more_m.terms["layer_step"] == pytest.approx(tied.terms["layer_step"] / 4)
    assert more_m.terms["layer_pass"] == tied.terms["layer_pass"]
    assert cost_model(_args(optimizer="adam"), _layer()).terms["layer_step"] < tied.terms["layer_step"]
    moe_layer = LayerShape(active_params=_layer().active_params, matrices=_layer().matrices, params=_layer().params,
                           expert_params=0)
    ep = cost_model(_args(num_experts=8, expert_model_parallel_size=4), moe_layer)
    assert ep.terms["layer_pass"] > cost_model(_args(num_experts=8), moe_layer).terms["layer_pass"]
    mtp = cost_model(_args(mtp_num_layers=1), _layer())
    assert mtp.terms["mtp_layers"] == pytest.approx(tied.layer + tied.terms["output_layer_and_loss"])


@pytest.mark.parametrize("unit", [1.0, 1e-6, 1e6])
def test_the_split_does_not_depend_on_the_cost_unit(unit):
    """Costs in seconds (a layer ~1e-6 s) split as the same costs in layers: the tie between
    equally slow splits is broken by evenness at any scale. Control: the brute-force best
    (most even among the fastest) is what comes back."""
    layers, head = 32, 19.6
    split = best_split([unit] * layers, 4, last_extra=head * unit)
    fastest = min(max(stage_costs(c, [1.0] * layers, last_extra=head)) for c in _compositions(layers, 4))
    evenest = min((sum(x * x for x in stage_costs(c, [1.0] * layers, last_extra=head)), c)
                  for c in _compositions(layers, 4)
                  if abs(max(stage_costs(c, [1.0] * layers, last_extra=head)) - fastest) < 1e-9)[1]
    assert split.layers == evenest, (unit, split.layers)


def test_the_memory_plan_counts_the_stash_of_every_delayed_run(plans):
    """The plan's stash term follows what the run holds (safety/save_space.stash_copies, as
    the save-space check counts it): one copy of the weights under 2bw, K under
    --simulated-delay K, none for a synchronous run (the control)."""
    for name, (flags, copies) in DELAYS.items():
        memory = plans[name][0]["memory_gb"]
        assert memory["stash"] == pytest.approx(copies * memory["weights"]), (flags, memory)

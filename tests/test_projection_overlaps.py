"""Megatron's overlaps against 2bw, priced by the projection (bench/throughput/project.py --overlaps).

For the 10B MoE and SmolLM-360M, Megatron's 1F1B and interleaved 1F1B get rows with CUDA
graphs and (MoE only) the EP all-to-all overlap of the combined step, at the split of the
row without them; 2BW gets the same overlaps, marked not implemented but for the EP overlap. The EP
overlap runs on each schedule's lists with combined steps, each step at its price. An
overlap only removes time, so no such row may be slower than its schedule without it; controls:
with no host time per operator, CUDA graphs change nothing, and with a large one they
speed every schedule up, so the term is live. No projected number is asserted.
"""

import dataclasses

import pytest

from bench.throughput import project

MODELS = ("moe-10b", "smollm-360m")


def _rows(model: str, host_us: float) -> list[dict]:
    """The overlap rows at PP=4 (m = 4, 8, 16; the full table takes a minute for the MoE)."""
    shape, _, dp, mbs, _ = project.LAYOUTS[model]
    return project.overlap_rows(shape, project.H100, pps=(4,), dp=dp, mbs=mbs, configured_m=8,
                                host_s_per_op=host_us * 1e-6)


@pytest.fixture(scope="module")
def rows():
    return {model: _rows(model, project.HOST_S_PER_OP * 1e6) for model in MODELS}


def _base(rows: list[dict]) -> dict:
    return {(r["schedule"], r["pp"], r["m"], r["layout"]): r for r in rows if "efficiency" in r}


@pytest.mark.parametrize("model", MODELS)
def test_each_overlap_row_is_produced_and_never_slower_than_its_schedule_without_it(rows, model):
    found, base = rows[model], _base(rows[model])
    timed = [r for r in found if "over_base" in r]
    names = {r["schedule"] for r in timed}
    ep = {"interleaved-1f1b+ep-overlap", "interleaved-1f1b+ep-overlap+cuda-graphs", "2bw+ep-overlap"}
    assert names >= {"1f1b+cuda-graphs", "interleaved-1f1b+cuda-graphs", "2bw+cuda-graphs"}
    assert (names >= ep) if model == "moe-10b" else not (names & ep)
    for r in timed:
        without = base[(r["base"], r["pp"], r["m"], r["layout"])]
        assert r["layers_per_stage"] == without["layers_per_stage"]
        assert r["over_base"] >= 1 and r["tokens_per_s_per_gpu"] >= without["tokens_per_s_per_gpu"], r
        assert r["implemented"] == (r["base"] != "2bw" or r["schedule"] == "2bw+ep-overlap")
    by = {(r["schedule"], r["pp"], r["m"], r["layout"]): r for r in timed}
    for (name, pp, m, layout), r in by.items():  # graphs on top of the EP overlap add to it too
        if name.endswith("+ep-overlap"):
            assert by[(name + "+cuda-graphs", pp, m, layout)]["tokens_per_s_per_gpu"] >= r["tokens_per_s_per_gpu"]
    if model == "moe-10b":  # plain 1F1B has no EP overlap in Megatron at PP > 1, and says why
        notes = [r for r in found if r["schedule"] == "1f1b+ep-overlap"]
        assert notes and all(r["note"] == project.NO_EP_OVERLAP_WITHOUT_VIRTUAL_STAGES for r in notes)
        # the EP overlap's term is live where interleaved 1F1B pairs passes
        assert any(r["over_base"] > 1 for r in timed if r["schedule"] == "interleaved-1f1b+ep-overlap")


def test_cuda_graphs_change_nothing_without_host_time_and_speed_up_when_launch_bound():
    for host_us, faster in ((0.0, False), (1000.0, True)):
        timed = [r for r in _rows("smollm-360m", host_us) if r["schedule"].endswith("+cuda-graphs") and "over_base" in r]
        assert timed and all((r["over_base"] > 1) == faster for r in timed), host_us


def test_the_ep_overlap_is_simulated_on_the_combined_step_lists(rows):
    """2BW's combined steps need m >= 2p-1 (a note below it); a combined step's price hides
    part of an MoE layer's all-to-all and nothing of a dense layer; under 2BW the slowest
    stage's combined step bounds the steady rate, and a step that hides nothing keeps the
    unpaired rate (the deeper warm-up costs nothing in the steady state)."""
    for r in rows["moe-10b"]:
        if r["schedule"] == "2bw+ep-overlap":
            short = r["m"] < project.min_microbatches_2bw_paired(r["pp"])
            assert ("2p-1" in r.get("note", "")) == short and ("tokens_per_s_per_gpu" in r) != short, r
    moe, dense = (project.gpu_costs(project.LAYOUTS[name][0], project.H100, 4, dp=project.LAYOUTS[name][2],
                                    mbs=project.LAYOUTS[name][3], m=8) for name in MODELS)
    assert all(c < f + b for f, b, c in zip(moe.fwd, moe.bwd, moe.pair))
    assert dense.pair == pytest.approx([f + b for f, b in zip(dense.fwd, dense.bwd)])
    unpaired = project.simulate_config("2bw", 4, 8, moe)
    assert max(moe.pair) <= project.simulate_config("2bw", 4, 8, moe, ep_overlap=True) < unpaired
    nothing = dataclasses.replace(moe, pair=[f + b for f, b in zip(moe.fwd, moe.bwd)])
    assert project.simulate_config("2bw", 4, 8, nothing, ep_overlap=True) == pytest.approx(unpaired)


def _table(report: str) -> list[dict]:
    lines = report.splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(header, (c.strip() for c in line.strip("|").split("|")))) for line in lines[2:]]


def test_the_overlap_report_names_what_wins_a_lost_lead_back(rows):
    for row in _table(project.overlap_report(rows["moe-10b"])):
        lead, wins = float(row["2bw / the fastest"].rstrip("x")), row["what wins it back (not implemented)"]
        assert (lead < 1) == bool(wins), row
        short = int(row["m"]) < project.min_microbatches_2bw_paired(int(row["p"]))
        assert (row["2bw+ep-overlap / the fastest"] == "n/a") == short, row

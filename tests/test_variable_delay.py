"""bench/delay/variable_delay.py keeps working: --quick runs both delayed variants at P in {2, 4}."""

import json
import math

import pytest


@pytest.fixture(autouse=True)
def warm_benchmark_ranks(monkeypatch):
    """The sweep's jobs on warm ranks (tests/support/launch.py's start_torchrun):
    these tests check what the sweep runs, records and resumes, not how fast."""
    from tests.support.launch import BENCH_WARM_ENV

    monkeypatch.setenv(BENCH_WARM_ENV, "1")


def test_quick_variable_delay_ablation(small_corpus, tmp_path):
    """The ablation's main in this process, so its jobs fork from this worker's warm ranks."""
    from bench.delay import variable_delay

    out = tmp_path / "vd"
    assert variable_delay.main(["--quick", "--out", str(out), "--data", str(small_corpus)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["table"]) == {"sync", "P=4"}
    for key in ("P=4",):
        for variant in ("constant", "pipedream"):
            cell = summary["table"][key][variant]
            assert math.isfinite(cell["mean"]), (key, variant)
            assert cell["gap"] == cell["mean"] - summary["table"]["sync"]["mean"]
    # each variant ran with its own delays, and every run trained
    commands = summary["commands"]
    assert "--simulated-delay 3,2,1,0" in commands["muon_lr0.008_pipedream_p4_s0"]
    assert "--simulated-delay 1 --simulated-pipeline-stages 4" in commands["muon_lr0.008_constant_p4_s0"]
    for name in commands:
        # (each of Megatron's evaluations reads the next validation batches, so two
        # evaluations of 2 batches are too noisy to compare; the training loss is not)
        losses = [loss for _, loss in json.loads((out / "runs" / name / "result.json").read_text())["train_curve"]]
        assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5, (name, losses)
    assert "| 4 |" in (out / "table.md").read_text()
    assert (out / "variable_delay.png").read_bytes()[:4] == b"\x89PNG"

"""The benchmarks run end to end (--quick: pipeline throughput in both harnesses, soak, schedule start-up).

Only that it completes and reports every configuration: timings on a shared CI
machine say nothing about speed, so none are asserted.
"""

import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import pipeline_throughput as bench  # noqa: E402


def test_quick_benchmark_reports_every_config(tmp_path):
    out = tmp_path / "bench.json"
    bench.main(["--quick", "--json", str(out)])
    results = json.loads(out.read_text())
    assert set(results["configs"]) == {name for name, *_ in bench.CONFIGS}
    for name, config in results["configs"].items():
        for key in ("s_per_microbatch", "simulated_s_per_microbatch"):
            assert math.isfinite(config[key]) and config[key] > 0, (name, key, config[key])
    for stages in results["stage_times"].values():
        assert all(t["fwd"] > 0 and t["bwd"] > 0 for t in stages)
    assert set(results["ratios"]) and all(v > 0 for v in results["ratios"].values())


def test_quick_soak_reports_pace_memory_and_bounded_sends(tmp_path, small_corpus):
    from bench import soak

    out = tmp_path / "soak"
    assert soak.main(["--quick", "--out", str(out), "--data", str(small_corpus)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["ranks"]) == {"rank0", "rank1"}
    for rank in summary["ranks"].values():
        assert rank["s_per_iter_early"] > 0 and rank["s_per_iter_late"] > 0
        assert rank["rss_mb_at_settle"] > 0
        assert max(rank["pending_sends"]) <= 4 * 4  # two batches of sends at m = 4


def test_quick_schedule_startup_reports_both_ways(tmp_path):
    from bench import schedule_startup

    out = tmp_path / "startup.json"
    assert schedule_startup.main(["--quick", "--pp", "4", "--microbatches", "4", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["iterations"] for r in rows] == [100, 1_000]
    for row in rows:
        assert all(row[k] > 0 for k in ("whole_s", "whole_mb", "streamed_s", "streamed_mb")), row


def test_quick_megatron_throughput_reports_an_efficiency(tmp_path):
    from bench import megatron_throughput

    out = tmp_path / "throughput.json"
    result = megatron_throughput.main(["--quick", "--json", str(out)])
    assert set(result["s_per_microbatch"]) == {"pp1_m4", "2bw_m4"}
    assert all(t > 0 for t in result["s_per_microbatch"].values())
    assert json.loads(out.read_text())["efficiency"]["2bw_m4"] > 0

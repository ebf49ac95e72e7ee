"""Simulator against closed-form bubbles, step collectives, exports and the CLI.

Expected values come from formulas, never from earlier simulator output. Uniform
stages with forward f, backward b, no latency and free optimizer steps:
- flushed schedules (gpipe, 1f1b): each batch takes (m+p-1)(f+b), bubble (p-1)/(m+p-1);
- 2bw / pipedream over n batches: one warm-up and one cool-down, (n*m+p-1)(f+b),
  bubble (p-1)/(n*m+p-1), steady throughput 1/(f+b).
- 2bw with a blocking collective at every step: stage s reaches step t s*b after the
  last stage (the backward wave), so it waits s*b there and, after the collective,
  (p-1-s)*b for the backward wave to come back. Every stage loses exactly the stage
  skew (p-1)*b per batch boundary: period m(f+b)+(p-1)b (+ sync_cost). The
  derivation is exact, so the tolerance is float round-off (1e-9).
"""

import json

import pytest

from megatron_async.schedules.generators import generate
from megatron_async.schedules.simulate_cli import main
from megatron_async.schedules.simulator import simulate, to_chrome_trace

SIZES = [(2, 2, 1), (2, 3, 3), (3, 3, 2), (4, 4, 1), (4, 8, 3), (5, 5, 2), (8, 8, 4), (4, 12, 2)]
COSTS = [(1.0, 2.0), (1.0, 1.0)]
approx = pytest.approx


@pytest.mark.parametrize("f,b", COSTS)
@pytest.mark.parametrize("p,m,n", SIZES + [(5, 2, 2), (4, 1, 3)])  # also m < p
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_flushed_bubble(name, p, m, n, f, b):
    r = simulate(generate(name, p, m, n), fwd=f, bwd=b)
    expected = (p - 1) / (m + p - 1)
    assert r.bubble_fraction == approx(expected, rel=1e-12)
    assert r.bubble_per_stage == approx([expected] * p, rel=1e-12)
    assert r.makespan == approx(n * (m + p - 1) * (f + b))
    if n >= 3:
        assert r.throughput == approx(m / ((m + p - 1) * (f + b)))


@pytest.mark.parametrize("f,b", COSTS)
@pytest.mark.parametrize("p,m,n", SIZES)
@pytest.mark.parametrize("name", ["2bw", "pipedream"])
def test_no_flush_bubble(name, p, m, n, f, b):
    r = simulate(generate(name, p, m, n), fwd=f, bwd=b)
    expected = (p - 1) / (n * m + p - 1)
    assert r.bubble_fraction == approx(expected, rel=1e-12)
    assert r.bubble_per_stage == approx([expected] * p, rel=1e-12)
    assert r.makespan == approx((n * m + p - 1) * (f + b))
    if n >= 3:
        assert r.throughput == approx(1 / (f + b))


def test_2bw_bubble_tends_to_zero():
    p, m = 4, 4
    bubbles = [simulate(generate("2bw", p, m, n)).bubble_fraction for n in (1, 4, 16, 64)]
    assert bubbles == sorted(bubbles, reverse=True)
    assert bubbles[-1] == approx((p - 1) / (64 * m + p - 1)) and bubbles[-1] < 0.012


def test_reports_peaks_from_validator():
    r = simulate(generate("2bw", 4, 4, 3))
    assert r.report.max_weight_versions == [2] * 4
    assert r.summary()["delay_per_stage"] == [1] * 4
    assert r.summary()["max_inflight_microbatches"] == [4, 3, 2, 1]


@pytest.mark.parametrize("sync_cost", [0.0, 0.5])
@pytest.mark.parametrize("f,b", [(1.0, 2.0), (1.0, 1.0), (1.0, 3.0)])
@pytest.mark.parametrize("p,m,n", [(2, 2, 3), (4, 4, 3), (4, 3, 4), (6, 8, 3), (8, 8, 4)])
def test_step_collective_costs_2bw_the_stage_skew_per_batch(p, m, n, f, b, sync_cost):
    sched = generate("2bw", p, m, n)
    free = simulate(sched, fwd=f, bwd=b)
    synced = simulate(sched, fwd=f, bwd=b, sync_at_step=True, sync_cost=sync_cost)
    skew = (p - 1) * b
    # without the collective: no bubble between batches (steps are m(f+b) apart)
    assert [t1 - t0 for t0, t1 in zip(free.step_end_times, free.step_end_times[1:])] == approx(
        [m * (f + b)] * (n - 1))
    # with it: every batch boundary costs every stage the skew (plus the collective)
    periods = [t1 - t0 for t0, t1 in zip(synced.step_end_times, synced.step_end_times[1:])]
    assert periods == approx([m * (f + b) + skew + sync_cost] * (n - 1), rel=1e-9)
    assert synced.makespan - free.makespan == approx((n - 1) * (skew + sync_cost) + sync_cost, rel=1e-9)
    if n >= 3:  # middle batches: m microbatches per period, idle share (skew + sync) / period
        assert synced.throughput == approx(m / (m * (f + b) + skew + sync_cost), rel=1e-9)
        assert free.throughput == approx(1 / (f + b))
        busy = sum(e.end - e.start for e in synced.events if e.stage == 0 and e.kind in ("forward", "backward")
                   and synced.step_end_times[0] < e.end <= synced.step_end_times[1])
        assert busy == approx(m * (f + b)) and periods[0] - busy > 0


def test_p2p_latency_on_the_critical_path():
    for p in (1, 2, 3, 5):  # one microbatch: p forwards, p backwards, 2(p-1) hops
        r = simulate(generate("1f1b", p, 1, 1), fwd=1, bwd=2, p2p=0.5)
        assert r.makespan == approx(p * 3 + 2 * (p - 1) * 0.5)


def test_imbalanced_stages_bound_throughput():
    fwd, bwd = [1, 1, 2, 1], [2, 2, 4, 2]
    r = simulate(generate("2bw", 4, 8, 6), fwd=fwd, bwd=bwd)
    assert r.throughput == approx(1 / max(f + b for f, b in zip(fwd, bwd)))
    assert r.bubble_per_stage[2] == min(r.bubble_per_stage)
    with pytest.raises(ValueError, match="one per stage"):
        simulate(generate("2bw", 4, 8, 1), fwd=[1, 2])


def test_optimizer_cost_counts_as_busy():
    p, m, n, o = 3, 3, 2, 0.5
    r = simulate(generate("1f1b", p, m, n), opt=o)
    assert r.busy_per_stage == approx([n * (m * 3 + o)] * p)


def test_chrome_trace():
    p, m, n = 3, 3, 2
    r = simulate(generate("2bw", p, m, n), sync_at_step=True)
    trace = json.loads(json.dumps(to_chrome_trace(r)))
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["tid"] for e in xs} == set(range(p))
    assert sum(e["cat"] == "forward" for e in xs) == p * m * n
    assert sum(e["cat"] == "optimizer" for e in xs) == p * n
    assert all(e["dur"] >= 0 and "ts" in e for e in xs)
    assert {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"} == {f"stage {s}" for s in range(p)}


def test_gantt_png(tmp_path):
    from megatron_async.schedules.gantt import plot_gantt

    out = plot_gantt(simulate(generate("2bw", 4, 4, 2), opt=0.5, sync_at_step=True), str(tmp_path / "g.png"))
    with open(out, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"


KEYS = {"bubble_fraction", "makespan", "max_weight_versions", "max_inflight_microbatches",
        "delay_per_stage", "throughput"}


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "2bw", "pipedream"])
def test_cli_json(name, capsys):
    assert main(["--schedule", name, "--pp", "4", "--microbatches", "4", "--batches", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert KEYS <= out.keys()
    assert len(out["max_weight_versions"]) == 4


def test_cli_table_plot_trace(tmp_path, capsys):
    png, tr = tmp_path / "x.png", tmp_path / "x.json"
    main(["--schedule", "2bw", "--pp", "2", "--microbatches", "2", "--fwd", "1,2", "--p2p", "0.1",
          "--plot", str(png), "--trace", str(tr)])
    assert "bubble" in capsys.readouterr().out
    assert png.stat().st_size > 0 and "traceEvents" in json.loads(tr.read_text())


def test_cli_refuses_too_few_microbatches_for_2bw(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--schedule", "2bw", "--pp", "4", "--microbatches", "2", "--json"])
    assert exc.value.code != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--microbatches" in err and "p-1 = 3" in err
    assert main(["--schedule", "2bw", "--pp", "4", "--microbatches", "3", "--json"]) == 0  # m = p-1 is enough


def test_cli_bad_flag_is_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--schedule", "1f1b", "--pp", "0", "--microbatches", "2"])
    assert exc.value.code != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--pp" in err


def test_cli_offers_a_schedule_registered_later(capsys):
    from megatron_async.schedules import registry

    registry.register_schedule("test-registered-2bw", generator="megatron_async.schedules.generators:two_bw")
    try:
        assert main(["--schedule", "test-registered-2bw", "--pp", "2", "--microbatches", "2", "--json"]) == 0
    finally:
        registry._REGISTRY.pop("test-registered-2bw")
    with pytest.raises(SystemExit):  # and only registered ones
        main(["--schedule", "test-registered-2bw", "--pp", "2", "--microbatches", "2", "--json"])
    assert "invalid choice" in capsys.readouterr().err

"""The simulator prices a combined forward-backward step at what it costs (`pair`).

A dependency model of 2bw with combined steps: forward f, backward b, a combined step
c < f + b, no latency, free optimizer steps. With warm-up w_s on stage s, step i on
stage s needs stage s+1's step i, which needs stage s's step i - (w_s - w_{s+1}):
- 2bw unpaired runs one microbatch per f + b;
- neighbours one warm-up forward apart (2bw's warm-up plus the one forward Megatron's
  combined schedule adds, w_s = p - s): each step waits on its neighbour's, which waits
  on this stage's previous one: one microbatch per 2c, slower than unpaired whenever
  2c > f + b;
- 2bw's own warm-up, w_s = p-1-s: the last stage has no forward to pair its backward
  with and runs f then b, and the stage before it waits on that: one microbatch per
  c + f + b on that link, 2c on the others, slower than unpaired;
- the deeper warm-up 2(p-1-s)+1 (gen_2bw_paired): two apart, one microbatch per c.
Expected values are these expressions of the cost parameters, never earlier output.
"""

import json

import pytest

from megatron_async.schedules.gantt import COLOURS
from megatron_async.schedules.gen_2bw import two_bw
from megatron_async.schedules.gen_2bw_paired import paired_2bw, two_bw_paired
from megatron_async.schedules.simulate_cli import main
from megatron_async.schedules.simulator import simulate, to_chrome_trace

F, B, PAIR = 1.0, 2.0, 2.4  # the dependency model: a combined step hides 0.6 of 3
approx = pytest.approx


def _per_microbatch(lists, pair=None) -> float:
    return 1.0 / simulate(lists, fwd=F, bwd=B, pair=pair).throughput


@pytest.mark.parametrize("p, m", [(4, 8), (4, 16), (3, 5), (6, 12)])
def test_steady_time_per_microbatch_follows_the_dependency_model(p, m):
    n = 6
    unpaired = _per_microbatch(two_bw(p, m, n))
    deep = _per_microbatch(two_bw_paired(p, m, n), PAIR)
    one_apart = _per_microbatch(paired_2bw(p, m, n, lambda s: p - s), PAIR)
    shallow = _per_microbatch(paired_2bw(p, m, n, lambda s: p - 1 - s), PAIR)
    assert unpaired == approx(F + B)
    assert deep == approx(PAIR)
    assert one_apart == approx(2 * PAIR) and one_apart > unpaired
    assert shallow == approx(max(2 * PAIR, PAIR + F + B)) and shallow > unpaired


def test_a_step_that_hides_nothing_runs_as_fast_as_unpaired():
    """Control: at pair = f + b the combined-step lists keep 2bw's pace (the deeper
    warm-up costs nothing in the steady state), and a cheaper step is faster."""
    p, m, n = 4, 8, 6
    assert _per_microbatch(two_bw_paired(p, m, n)) == approx(_per_microbatch(two_bw(p, m, n)))
    assert _per_microbatch(two_bw_paired(p, m, n), [PAIR] * p) < _per_microbatch(two_bw(p, m, n))


def test_a_combined_step_is_one_event_with_both_microbatches():
    r = simulate(two_bw_paired(4, 8, 2), fwd=F, bwd=B, pair=PAIR)
    steps = [e for e in r.events if e.kind == "forward_backward"]
    assert steps and all(e.end - e.start == approx(PAIR) and e.paired[0] != e.microbatch for e in steps)
    names = [t["name"] for t in to_chrome_trace(r)["traceEvents"] if t.get("cat") == "forward_backward"]
    assert names and all(" + B" in name for name in names)
    assert {e.kind for e in r.events} <= set(COLOURS)  # the Gantt chart has a colour for each


def test_cli_simulates_and_validates_the_paired_lists(capsys):
    p, m = 4, 8
    assert main(["--schedule", "2bw", "--pp", str(p), "--microbatches", str(m), "--batches", "5",
                 "--overlap-moe-expert-parallel-comm", "--fwd", str(F), "--bwd", str(B), "--pair", str(PAIR),
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["throughput"] == approx(1 / PAIR)
    assert out["max_inflight_microbatches"] == [2 * (p - s) for s in range(p)]
    assert out["max_weight_versions"] == [2] * p


@pytest.mark.parametrize("argv, flag", [
    (["--schedule", "2bw", "--pp", "4", "--microbatches", "6"], "--microbatches"),
    (["--schedule", "1f1b", "--pp", "4", "--microbatches", "8"], "--overlap-moe-expert-parallel-comm"),
])
def test_cli_refusals_are_one_line_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv + ["--overlap-moe-expert-parallel-comm"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert err.startswith(f"megatron-async-simulate: error: {flag}: ")
    assert "--overlap-moe-expert-parallel-comm" in err

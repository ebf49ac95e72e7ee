"""What the weight stash costs an iteration on a GPU (1 GPU; TE for the TE case): reported, not asserted.

The Megatron-loop run of test_gpu_megatron_loop.py, plain and with
`--simulated-delay 1`, alternately (plain, delay, plain, delay, ...) on the same
GPU so drift hits both alike. Each run's time is the median s/iteration after its
first SKIP iterations (start-up, autotuning); the ratio is median(delay) /
median(plain) over the runs. It is printed and written to
$MEGATRON_ASYNC_GPU_REPORT/stash_overhead_IMPL.json (default out/gpu/), once with
Transformer Engine layers and once with Megatron's local layers.
"""

import statistics

import pytest

from tests.support.gpu.gpt_flags import MUON, gpt_flags
from tests.support.gpu.launch import iteration_seconds, read_metrics, tail, torchrun_gpt
from tests.support.gpu.report import report_dir, write_json

ROUNDS = 2
ITERS = 40
SKIP = 10
TIMEOUT_S = 600
MODES = {"plain": [], "delay": ["--simulated-delay", 1]}


@pytest.mark.parametrize("impl", [pytest.param("transformer_engine", marks=pytest.mark.te), "local"])
@pytest.mark.timeout(ROUNDS * len(MODES) * TIMEOUT_S + 120)
def test_stash_overhead_side_by_side(impl, tmp_path, gpu_record, gpu_env, capsys):
    per_run = {mode: [] for mode in MODES}
    for round_ in range(ROUNDS):
        for mode, extra in MODES.items():
            metrics = tmp_path / f"{mode}_{round_}.jsonl"
            flags = gpt_flags(iters=ITERS, impl=impl) + MUON + extra + ["--metrics-json", metrics]
            proc = torchrun_gpt(flags, 1, TIMEOUT_S)
            assert proc.returncode == 0, tail(proc)
            seconds = iteration_seconds(read_metrics(metrics), SKIP)
            assert len(seconds) == ITERS - SKIP, seconds
            per_run[mode].append(statistics.median(seconds))
    medians = {mode: statistics.median(runs) for mode, runs in per_run.items()}
    result = {"device": gpu_env.get("device"), "impl": impl, "rounds": ROUNDS, "iterations": ITERS,
              "skipped": SKIP,
              "s_per_iter_by_run": per_run, "median_s_per_iter": medians,
              "delay_over_plain": medians["delay"] / medians["plain"]}
    path = write_json(report_dir() / f"stash_overhead_{impl}.json", result)
    gpu_record(**result)
    with capsys.disabled():
        print(f"\nstash overhead on {result['device']} ({impl}): plain {medians['plain'] * 1e3:.1f} ms/iter, "
              f"--simulated-delay 1 {medians['delay'] * 1e3:.1f} ms/iter, ratio {result['delay_over_plain']:.3f} "
              f"({path})")

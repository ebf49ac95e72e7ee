"""2bw with Megatron's --overlap-moe-expert-parallel-comm on real NCCL, four ranks on one GPU
(`make test-gpu-ranks`), under torch.profiler.

EP=2 x PP=2 (4 ranks, DP=2: m = 16 / (2 x 2) = 4 >= 2p-1), MoE with the all-to-all
dispatcher, Megatron's local layers, bf16, Adam: one job with the flag and one without,
the same flags otherwise, each rank profiled over train steps PROFILED
(tests/support/gpu/profile_entry.py). From each rank's trace
(tests/support/gpu/kernel_overlap.py): the all-to-all kernels, and the share of their time
during which a GEMM ran on another stream, the other microbatch's compute. With the flag
some all-to-all kernel runs beside a GEMM, and a larger share of their time than without it
(control: without the flag each all-to-all is waited for by the compute after it).
Per-iteration time (the median of the metrics file's, over the iterations after the
profiled ones and the trace's export) with and without the flag, and their ratio.

On the CPU dry run the jobs run on gloo without CUDA kernels: the ratio is recorded and the
overlap assertion is skipped, saying why. The four ranks share one GPU by time slices
(shared_gpu_entry.py), so the ratio is this layout's, not a cluster's.
"""

import statistics
import sys

import pytest

from tests.support.gpu.gpt_flags import gpt_flags, two_bw
from tests.support.gpu.kernel_overlap import overlaps
from tests.support.gpu.launch import DETERMINISTIC_ENV, iteration_seconds, read_metrics, run_with_timeout, tail
from tests.support.gpu.profile_entry import DIR_ENV, ITERATIONS_ENV

ITERS = 12
PROFILED = (4, 6)  # train steps 4 and 5; the trace is written at the end of step 5
TIMED_FROM = 8  # iterations from here on are neither profiled nor exporting
TIMEOUT_S = 300
FLAG = "--overlap-moe-expert-parallel-comm"
MOE = ["--num-experts", 4, "--moe-router-topk", 2, "--expert-model-parallel-size", 2, "--moe-token-dispatcher-type",
       "alltoall", "--moe-aux-loss-coeff", 1e-2, "--disable-bias-linear"]
ARGS = gpt_flags(layers=4, hidden=128, heads=4, seq=128, micro_batch=2, global_batch=16, iters=ITERS,
                 impl="local") + MOE + two_bw(2) + ["--layout-invariant-init"]
ENV = {**DETERMINISTIC_ENV, "MEGATRON_ASYNC_CPU_SEND_WAIT_S": "20"}  # the second: the CPU dry run's NCCL waits


def _profiled_job(record, tmp_path, case: str, args: list) -> tuple[float, dict]:
    """(the median seconds of the iterations from TIMED_FROM on, the overlap summed over the
    ranks' traces)."""
    traces = tmp_path / case.replace(" ", "_")
    metrics = traces / "metrics.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           "-m", "tests.support.gpu.profile_entry", "--gpt", *map(str, args), "--metrics-json", str(metrics)]
    env = {**ENV, DIR_ENV: str(traces), ITERATIONS_ENV: f"{PROFILED[0]}:{PROFILED[1]}"}
    try:
        proc = run_with_timeout(cmd, TIMEOUT_S, env=env, nproc=4)
    except TimeoutError as err:
        raise TimeoutError(f"case {case!r}: {err}") from None
    record.launch(case, proc)
    assert proc.returncode == 0, f"case {case!r}:\n{tail(proc)}"
    seconds = iteration_seconds(read_metrics(metrics), skip=TIMED_FROM - 1)
    assert len(seconds) == ITERS - TIMED_FROM + 1, f"case {case!r}: iteration times {seconds}"
    return statistics.median(seconds), overlaps(sorted(traces.glob("trace_rank*.json")))


def test_2bw_ep_overlap_hides_the_all_to_all_behind_gemms(tmp_path, record):
    import torch

    s_with, overlap = _profiled_job(record, tmp_path, "EP=2 x PP=2 with the EP overlap", ARGS + [FLAG])
    s_without, control = _profiled_job(record, tmp_path, "EP=2 x PP=2 without it", ARGS)
    record(s_per_iteration_with=s_with, s_per_iteration_without=s_without, with_over_without=s_with / s_without,
           timed_iterations=f"{TIMED_FROM}..{ITERS}", overlap_with=overlap, overlap_without=control)
    if not torch.cuda.is_available():
        pytest.skip("CPU dry run: no CUDA kernels in the traces, so no all-to-all kernel to find beside a GEMM "
                    f"(found {overlap['all_to_all_kernels']}); the ratio is recorded")
    assert overlap["all_to_all_kernels"] > 0, "no all-to-all kernel found in the traces"
    assert overlap["all_to_all_kernels_beside_a_gemm"] > 0, f"with {FLAG} no all-to-all kernel ran beside a GEMM"
    assert overlap["overlapped_share"] > control["overlapped_share"], (overlap, control)

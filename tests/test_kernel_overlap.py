"""The profiler-trace reading of `make test-gpu-ranks`'s EP-overlap case
(tests/support/gpu/kernel_overlap.py), on hand-made traces in torch.profiler's Chrome format:
all-to-all kernels are told from the pipeline's point-to-point kernels by the host op their
launch sits in, not by name; only GEMMs on another stream count; overlapping GEMMs are
counted once. Controls: the same kernels with the GEMMs after the all-to-all overlap nothing,
and a trace without kernels (the CPU dry run) has no all-to-all kernel."""

from tests.support.gpu.kernel_overlap import overlap, overlaps

HOST, DEVICE = 100, 0


def _op(name, ts, dur, tid=1):
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": HOST, "tid": tid, "ts": ts, "dur": dur}


def _launch(correlation, ts, tid=1, cat="cuda_runtime"):
    return {"ph": "X", "cat": cat, "name": "cudaLaunchKernel", "pid": HOST, "tid": tid, "ts": ts, "dur": 1,
            "args": {"correlation": correlation}}


def _kernel(name, correlation, stream, ts, dur):
    return {"ph": "X", "cat": "kernel", "name": name, "pid": DEVICE, "tid": stream, "ts": ts, "dur": dur,
            "args": {"correlation": correlation, "stream": stream}}


NCCL = "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)"


def _trace(gemm_start: float) -> dict:
    return {"traceEvents": [
        _op("c10d::alltoall_base_", 40, 20), _launch(1, 50, cat="cuda_driver"),
        _kernel(NCCL, 1, 20, 100, 100),  # the all-to-all: 100..200 on stream 20
        _op("nccl:send", 60, 10), _launch(2, 65), _kernel(NCCL, 2, 30, 100, 100),  # a pipeline send, same name
        _launch(3, 70), _kernel("nvjet_tst_128x64_64x4_h_bz_TNN", 3, 7, gemm_start, 100),
        _launch(4, 71), _kernel("ampere_bf16_s16816gemm_bf16_128x64", 4, 7, gemm_start - 30, 40),
        _launch(5, 72), _kernel("sm90_xmma_gemm_bf16bf16", 5, 20, 100, 100),  # the all-to-all's own stream
        _launch(6, 73), _kernel("vectorized_elementwise_kernel", 6, 7, 100, 100),  # not a GEMM
    ]}


def test_all_to_all_kernels_beside_gemms_on_another_stream():
    found = overlap(_trace(gemm_start=150))
    assert found["all_to_all_kernels"] == 1 and found["all_to_all_streams"] == ["20"]
    # GEMMs on stream 7: 120..160 and 150..250, over the all-to-all's 100..200: 120..200, counted once
    assert found["overlapped_us"] == 80.0 and found["overlapped_share"] == 0.8
    assert found["all_to_all_kernels_beside_a_gemm"] == 1 and found["gemm_kernels"] == 3


def test_control_gemms_after_the_all_to_all_overlap_nothing():
    found = overlap(_trace(gemm_start=240))
    assert found["all_to_all_kernels"] == 1
    assert found["overlapped_us"] == 0.0 and found["all_to_all_kernels_beside_a_gemm"] == 0


def test_a_trace_without_kernels_has_no_all_to_all_kernel():
    host_only = {"traceEvents": [_op("c10d::alltoall_base_", 40, 20), _op("aten::mm", 70, 5)]}
    assert overlap(host_only)["all_to_all_kernels"] == 0
    assert overlaps([host_only, host_only])["overlapped_share"] == 0.0

"""CUDA emulation: maps Megatron's CUDA calls to the CPU, and never activates beside CUDA."""

import sys

import pytest
import torch

from megatron_async import cpu
from megatron_async.launch import with_cpu_flags
from tests.support.multiprocess import run_distributed
from tests.support.tiny_gpt import TinyGPT, train_entry
from tests.support.trajectory import assert_same_trajectory


def test_inactive_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    original = torch.cuda.current_device
    assert cpu.activate() is False
    assert not cpu.is_active()
    assert torch.cuda.current_device is original
    assert torch._C._len_torch_function_stack() == 0
    with pytest.raises(RuntimeError, match="--device cpu"):
        cpu.setup_device("cpu")
    assert cpu.setup_device("auto") == "cuda"
    # nor is apex's weight-gradient kernel provided: a GPU run uses the real one or none
    from megatron.core.tensor_parallel import layers

    assert cpu.FUSED_WGRAD_MODULE not in sys.modules
    assert not hasattr(layers, cpu.FUSED_WGRAD_MODULE) and layers._grad_accum_fusion_available is False


def test_device_cuda_without_cuda_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="--device cuda"):
        cpu.setup_device("cuda")


def _emulated_calls(rank, world_size):
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    out = {}
    out["factory"] = torch.empty(3, device="cuda").device.type
    out["int_device"] = torch.zeros(2, device=torch.cuda.current_device()).device.type
    out["to_cuda"] = torch.ones(2).to("cuda:0").device.type
    out["dot_cuda"] = torch.ones(2).cuda().device.type
    out["type_name"] = torch.ones(2).type()
    out["bf16_type_name"] = torch.ones(2, dtype=torch.bfloat16).type()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        event = torch.cuda.Event()
        event.record()
    torch.cuda.current_stream().wait_stream(stream)
    out["event_done"] = event.query()
    # Megatron's combined 1F1B step: a high-priority communication stream, tensors marked on it
    from megatron.core.pipeline_parallel.utils import get_comm_stream, set_streams

    set_streams(high_priority=True)
    handed = torch.ones(2, device="cuda")
    handed.record_stream(get_comm_stream())
    out["comm_priority"] = (get_comm_stream().priority, torch.cuda.Stream.priority_range()[1])
    torch.cuda.synchronize()
    model_parallel_cuda_manual_seed(7)
    tracker = get_cuda_rng_tracker()
    with tracker.fork():
        first = torch.rand(4)
    outside = torch.rand(4)
    model_parallel_cuda_manual_seed(7)
    with tracker.fork():
        again = torch.rand(4)
    out["fork_repeatable"] = torch.equal(first, again)
    out["fork_isolated"] = not torch.equal(first, outside)

    class Doubler(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            # Megatron's backward passes allocate on current_device().
            return grad * 2 + torch.zeros(grad.shape, device=torch.cuda.current_device())

    x = torch.ones(3, requires_grad=True)
    Doubler.apply(x).sum().backward()
    out["custom_backward"] = x.grad.tolist()
    return out


def test_emulated_cuda_calls_run_on_cpu():
    (out,) = run_distributed(_emulated_calls, 1)
    assert out["factory"] == out["int_device"] == out["to_cuda"] == out["dot_cuda"] == "cpu"
    assert out["type_name"] == "torch.cuda.FloatTensor"
    assert out["bf16_type_name"] == "torch.cuda.BFloat16Tensor"
    assert out["event_done"] is True
    priority, highest = out["comm_priority"]
    assert priority == highest < 0
    assert out["fork_repeatable"] and out["fork_isolated"]
    assert out["custom_backward"] == [2.0, 2.0, 2.0]


def _uneven_all_gather(rank, world_size):
    import torch.distributed as dist

    cpu.activate()
    sizes = [3, 5]
    mine = torch.arange(sizes[rank], dtype=torch.float32) + 10 * rank
    outs = [torch.empty(n, device="cuda") for n in sizes]
    work = dist.all_gather(outs, mine, async_op=True)
    work.wait()
    even = [torch.empty(2) for _ in sizes]
    dist.all_gather(even, torch.full((2,), float(rank)))
    return [o.tolist() for o in outs], [e.tolist() for e in even]


def test_all_gather_of_unequal_sizes_on_gloo():
    """NCCL's all_gather accepts unequal sizes (Megatron's layer-wise optimizer relies on it)."""
    for uneven, even in run_distributed(_uneven_all_gather, 2):
        assert uneven == [[0.0, 1.0, 2.0], [10.0, 11.0, 12.0, 13.0, 14.0]]
        assert even == [[0.0, 0.0], [1.0, 1.0]]


# --- apex's fused weight-gradient accumulation, emulated -----------------------------
# Reference: main_grad + the sum of outer products grad[n] x input[n] in fp64, rounded to
# main_grad's dtype. Tolerances: fp32 1e-5 (fp32 GEMM vs fp64 over 12 rows of O(1) terms);
# bf16/fp16 main_grad: two units in the last place (2**-7 / 2**-9 relative: the kernel
# rounds once from fp32, the reference once from fp64), 1e-5 absolute near zero.
WGRAD_CASES = {  # input dtype, main_grad dtype, kernel, rtol
    "fp32": (torch.float32, torch.float32, "wgrad_gemm_accum_fp32", 1e-5),
    "bf16_into_fp32": (torch.bfloat16, torch.float32, "wgrad_gemm_accum_fp32", 1e-5),
    "bf16": (torch.bfloat16, torch.bfloat16, "wgrad_gemm_accum_fp16", 2**-7),
    "fp16": (torch.float16, torch.float16, "wgrad_gemm_accum_fp16", 2**-9),
}


def _wgrad_inputs(in_dtype, grad_dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    total_input = torch.randn(3, 4, 5, generator=gen).to(in_dtype)  # [seq, batch, in]
    grad_output = torch.randn(3, 4, 6, generator=gen).to(in_dtype)  # [seq, batch, out]
    main_grad = torch.randn(6, 5, generator=gen).to(grad_dtype)
    return total_input, grad_output, main_grad


def _outer_product_sum(total_input, grad_output):
    rows_in = total_input.reshape(-1, total_input.shape[-1]).double()
    rows_grad = grad_output.reshape(-1, grad_output.shape[-1]).double()
    return sum(torch.outer(g, x) for g, x in zip(rows_grad, rows_in))


@pytest.mark.parametrize("case", list(WGRAD_CASES))
def test_emulated_wgrad_kernel_accumulates_the_weight_gradient(case):
    in_dtype, grad_dtype, kernel, rtol = WGRAD_CASES[case]
    total_input, grad_output, main_grad = _wgrad_inputs(in_dtype, grad_dtype)
    initial = main_grad.double()
    product = _outer_product_sum(total_input, grad_output)
    getattr(cpu, kernel)(total_input, grad_output, main_grad)
    once = main_grad.clone()
    torch.testing.assert_close(once, (initial + product).to(grad_dtype), rtol=rtol, atol=1e-5)
    getattr(cpu, kernel)(total_input, grad_output, main_grad)
    torch.testing.assert_close(main_grad, (once.double() + product).to(grad_dtype), rtol=rtol, atol=1e-5)
    # negative control: the same comparison rejects an overwrite (main_grad = product)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(product.to(grad_dtype), (initial + product).to(grad_dtype), rtol=rtol, atol=1e-5)


def test_emulated_wgrad_kernels_refuse_the_other_main_grad_dtype_and_a_shape_mismatch():
    total_input, grad_output, main_grad = _wgrad_inputs(torch.float32, torch.float32)
    with pytest.raises(TypeError, match="fp16/bf16"):
        cpu.wgrad_gemm_accum_fp16(total_input, grad_output, main_grad)
    with pytest.raises(TypeError, match="fp32"):
        cpu.wgrad_gemm_accum_fp32(total_input, grad_output, main_grad.bfloat16())
    with pytest.raises(ValueError, match="does not match"):  # add_ would broadcast a [1, in] main_grad
        cpu.wgrad_gemm_accum_fp32(total_input, grad_output, torch.zeros(1, 5))


def _fusion_kernel_installed(rank, world_size):
    from megatron.core.tensor_parallel import layers

    module = sys.modules.get(cpu.FUSED_WGRAD_MODULE)
    return {
        "module": module is not None and module.wgrad_gemm_accum_fp32 is cpu.wgrad_gemm_accum_fp32,
        "layers_global": getattr(layers, cpu.FUSED_WGRAD_MODULE, None) is module,
        "available": layers._grad_accum_fusion_available,
    }


def test_emulation_provides_the_fused_wgrad_kernel_to_megatron():
    (out,) = run_distributed(_fusion_kernel_installed, 1)
    assert out == {"module": True, "layers_global": True, "available": True}


def _train_with_overwriting_wgrad_kernel(rank, world_size, spec, steps):
    """The rank's fused weight-gradient kernel overwrites main_grad instead of adding."""

    def overwrite(total_input, grad_output, main_grad):
        main_grad.zero_()
        cpu.wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)

    sys.modules[cpu.FUSED_WGRAD_MODULE].wgrad_gemm_accum_fp32 = overwrite
    return train_entry(rank, world_size, spec, steps)


def test_gradient_accumulation_fusion_trains_like_plain_accumulation():
    """Fused (kernel into main_grad, DDP skips the dummy gradient via grad_added_to_main_grad)
    equals unfused (wgrad, then DDP's hook adds it) over 4 microbatches a step. Tolerance
    1e-6: the kernel does the unfused path's two fp32 operations (observed bitwise).
    Negative control: a kernel that overwrites gives another trajectory, so the fused
    path is what ran."""
    steps, spec = 6, dict(init_by_name=True, clip_grad=0.0)
    (plain,) = run_distributed(train_entry, 1, TinyGPT(**spec), steps)
    (fused,) = run_distributed(train_entry, 1, TinyGPT(gradient_accumulation_fusion=True, **spec), steps)
    assert_same_trajectory(plain, [fused], 1e-6, 1e-6)
    (broken,) = run_distributed(_train_with_overwriting_wgrad_kernel, 1,
                                TinyGPT(gradient_accumulation_fusion=True, **spec), steps)
    with pytest.raises(AssertionError):
        assert_same_trajectory(plain, [broken], 1e-6, 1e-6)


def test_cpu_runs_keep_gradient_accumulation_fusion_unless_turned_off():
    assert "--no-gradient-accumulation-fusion" not in with_cpu_flags(["--num-layers", "2"])
    kept = with_cpu_flags(["--no-gradient-accumulation-fusion"])
    assert kept.count("--no-gradient-accumulation-fusion") == 1

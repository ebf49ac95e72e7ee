"""CUDA emulation: maps Megatron's CUDA calls to the CPU, and never activates beside CUDA."""

import pytest
import torch

from megatron_async import cpu
from megatron_async.testing.multiprocess import run_distributed


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

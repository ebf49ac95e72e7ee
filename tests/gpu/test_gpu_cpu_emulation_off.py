"""The CPU emulation never activates beside CUDA (1 GPU).

On the CPU, megatron_async/cpu.py redirects `torch.cuda` to the host; on a GPU
node that would move a user's training silently onto the CPU. Here, with CUDA
present, `setup_device("auto")` must answer cuda, `activate()` must refuse, a
request for `--device cpu` must fail naming the fix, and `torch.cuda` must still
place tensors on the GPU afterwards.
"""

import pytest


def test_emulation_refuses_to_activate_beside_cuda():
    import torch

    from megatron_async import cpu

    assert torch.cuda.is_available()
    assert cpu.setup_device("auto") == "cuda"
    assert cpu.activate() is False
    assert not cpu.is_active()
    with pytest.raises(RuntimeError, match="CUDA is available"):
        cpu.setup_device("cpu")
    tensor = torch.ones(4, device="cuda")
    assert tensor.is_cuda and tensor.device.type == "cuda"
    assert torch.cuda.current_device() == 0

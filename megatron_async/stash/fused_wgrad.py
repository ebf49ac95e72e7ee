"""Keep DDP's fused weight-gradient contract in backwards whose forward ran under the stash's hooks.

With gradient-accumulation fusion (Megatron's default, and Transformer Engine's
`fuse_wgrad_accumulation`) a linear layer's backward adds its weight gradient
straight into `weight.main_grad`; when the weight carries DDP's
`grad_added_to_main_grad` it sets that flag and returns a dummy gradient, which
DDP's backward hook then skips. With `--overlap-grad-reduce` the hook asserts that
a gradient came.

Once saved-tensor hooks are active (the stash's, for forwards whose backward comes
after an optimizer step), autograd rebuilds every unpacked tensor as a new plain
tensor, so such a layer's backward sees its weight without the Parameter's Python
attributes: it still accumulates into `main_grad` (captured at its forward) but
finds no flag and returns None, and DDP's hook stops the run. Autograd lets no hook
turn a None gradient into a tensor, so before that microbatch's backward
`give_dummy_grads` does on the Parameters what the layer would have done: the flag,
and a zero dummy as `.grad` for DDP's hook to find and drop.

The hook of a None gradient runs on autograd's CPU thread, not the device's; that
is harmless where it only counts (DDP acts on the last microbatch of a batch), and
2bw's flags refuse the one layout whose hooked forwards include a batch's last
microbatch (`--overlap-grad-reduce` with fusion and fewer microbatches than stages).
"""

from __future__ import annotations

import torch

# what Megatron's local linear layers (`gradient_accumulation_fusion`) and Transformer
# Engine's modules (`fuse_wgrad_accumulation`) keep on their autograd context
FUSION_FLAGS = ("gradient_accumulation_fusion", "fuse_wgrad_accumulation")


def _fuses(node) -> bool:
    return any(getattr(node, flag, False) is True for flag in FUSION_FLAGS)


def fused_weights(outputs, params: dict) -> list[torch.nn.Parameter]:
    """The GEMM weights (matrices of `params`: id -> Parameter, with DDP's flag) that a
    node declaring fusion takes, in the autograd graph behind `outputs` (a tensor or
    tensors). A fused node's vectors (bias, a fused norm's weight) get real gradients."""
    if isinstance(outputs, torch.Tensor):
        outputs = [outputs]
    stack = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen: set = set()
    found: dict = {}
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        fuses = _fuses(node)
        for child, _ in node.next_functions:
            if child is None:
                continue
            variable = getattr(child, "variable", None)  # an AccumulateGrad node's leaf
            if variable is None:
                stack.append(child)
            elif fuses and variable.dim() >= 2 and id(variable) in params \
                    and hasattr(variable, "grad_added_to_main_grad"):
                found[id(variable)] = variable
    return list(found.values())


def _empty_sparse(param: torch.nn.Parameter) -> torch.Tensor:
    indices = torch.empty((param.dim(), 0), dtype=torch.long, device=param.device)
    values = torch.empty((0,), dtype=param.dtype, device=param.device)
    return torch.sparse_coo_tensor(indices, values, param.shape, check_invariants=True)


def give_dummy_grads(weights) -> None:
    """What a fused layer does to the Parameter it sees: flag its gradient as added to
    `main_grad` and give DDP a dummy to drop. The dummy is an empty sparse tensor: it costs
    no memory, and a real gradient the same weight also gets in this backward (multi-token
    prediction's embedding on the last stage is the output weight) lands beside it as
    autograd adds a dense gradient to a sparse one, then is dropped with it by DDP, as
    Megatron's own dummy makes DDP drop it without the hooks."""
    for param in weights:
        param.grad_added_to_main_grad = True
        if param.grad is None:
            param.grad = _empty_sparse(param)

"""A CPU stand-in for Transformer Engine's Linear: the per-batch weight behaviours 2bw must survive.

TE's Linear keys three behaviours on the `is_first_microbatch` argument. Megatron's
TE wrappers pass it as `None if self.disable_parameter_transpose_cache else
self.is_first_microbatch` and then clear their flag; Megatron's schedule raises
the flag on every module that has it at each batch's first microbatch
(`set_is_first_microbatch`, when the run quantizes). The weight stash cannot see
inside such a kernel, so tests install this stand-in on Megatron's local linear
layers (TP=1) to check that 2bw handles each behaviour:

- "fp8_cache": a cached copy of the weight (standing in for the quantized one) is
  refreshed in place only when the flag is True, without bumping autograd's version
  counter (TE does it in C++); forward and backward use that copy. With None the
  copy is made afresh on every call and nothing is cached.
- "fused_wgrad": with gradient-accumulation fusion, the weight gradient goes
  straight into `weight.main_grad`, overwriting it when the flag is True and adding
  otherwise (None: always adding); a dummy weight gradient is returned and
  `grad_added_to_main_grad` set, so Megatron's DDP does not add it again.
- "alias": the kernel saves `weight.detach()` for backward: the weight's storage,
  but neither the Parameter nor an autograd view of it.

`honour_switch=False` makes a kernel that ignores `disable_parameter_transpose_cache`
(always passing the flag): the silent failure the switch exists to prevent.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

KINDS = ("fp8_cache", "fused_wgrad", "alias")
SWITCH = "disable_parameter_transpose_cache"


class _QuantizingRun:
    """Marks a model config as quantizing (as `fp8` does), so Megatron's own
    `set_is_first_microbatch` raises the flag each batch; `quant_recipe` is read
    nowhere else once the model is built, unlike `fp8` (which would ask for TE)."""

    def __repr__(self) -> str:
        return "te_like per-batch weight cache"


QUANTIZING = _QuantizingRun()


@dataclass
class _KernelState:
    kind: str
    honour_switch: bool
    cache: Optional[torch.Tensor] = None  # fp8_cache: the cached weight copy

    def compute_weight(self, weight: torch.Tensor, first: Optional[bool]) -> torch.Tensor:
        """The weight the fp8_cache kernel computes with (and saves for its backward)."""
        if first is None:  # no cache: quantize afresh
            return weight.detach().clone()
        if self.cache is None:
            self.cache = weight.detach().clone()
        elif first:  # refresh in place, as TE's C++ does: autograd sees no modification
            self.cache.data.copy_(weight.detach())
        return self.cache


class _TELikeLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, weight, bias, state: _KernelState, fuse_wgrad: bool, first: Optional[bool]):
        used = state.compute_weight(weight, first) if state.kind == "fp8_cache" else weight
        output = torch.matmul(input_, used.t())
        if bias is not None:
            output = output + bias
        saved = weight.detach() if state.kind == "alias" else used
        ctx.save_for_backward(input_, saved)
        ctx.use_bias = bias is not None
        # Like Megatron's own kernel: main_grad and the Parameter are kept on ctx, not saved.
        ctx.main_grad = weight.main_grad if fuse_wgrad and hasattr(weight, "main_grad") else None
        ctx.param = weight
        ctx.accumulate = not first if state.kind == "fused_wgrad" else True  # None: always add
        return output

    @staticmethod
    def backward(ctx, grad_output):
        input_, saved = ctx.saved_tensors
        grad_input = grad_output.matmul(saved)
        flat_grad = grad_output.reshape(-1, grad_output.shape[-1])
        wgrad = flat_grad.t().matmul(input_.reshape(-1, input_.shape[-1]))
        grad_weight = wgrad
        if ctx.main_grad is not None:
            if ctx.accumulate:
                ctx.main_grad.add_(wgrad)
            else:
                ctx.main_grad.copy_(wgrad)
            grad_weight = None
            if hasattr(ctx.param, "grad_added_to_main_grad"):  # Megatron's DDP: a dummy it will not add
                ctx.param.grad_added_to_main_grad = True
                grad_weight = torch.zeros_like(wgrad)
        grad_bias = flat_grad.sum(dim=0) if ctx.use_bias else None
        return grad_input, grad_weight, grad_bias, None, None, None


def _kernel(module, input_, weight, bias):
    """Read the flag as Megatron's TE wrappers do, then clear it."""
    state: _KernelState = module.te_like_state
    first = module.is_first_microbatch
    if state.honour_switch and getattr(module, SWITCH, False):
        first = None
    module.is_first_microbatch = False
    return _TELikeLinear.apply(input_, weight, bias, state, module.config.gradient_accumulation_fusion, first)


def _column_forward(self, input_, weight=None, runtime_gather_output=None):
    """ColumnParallelLinear's contract at TP=1: (output, bias if skip_bias_add else None)."""
    weight = self.weight if weight is None else weight
    output = _kernel(self, input_, weight, None if self.skip_bias_add else self.bias)
    return output, self.bias if self.skip_bias_add else None


def _row_forward(self, input_):
    """RowParallelLinear's contract at TP=1: (output, bias if skip_bias_add else None)."""
    output = _kernel(self, input_, self.weight, None if self.skip_bias_add else self.bias)
    return output, self.bias if self.skip_bias_add else None


def install(model_chunks, kind: str, honour_switch: bool = True) -> list[str]:
    """Give every local Column/RowParallelLinear the TE-like kernel `kind`, the
    `is_first_microbatch` flag and the `disable_parameter_transpose_cache` switch
    (from the config, as Megatron's TE wrappers); return the modules' names."""
    if kind not in KINDS:
        raise ValueError(f"te_like kind must be one of {KINDS}, got {kind!r}")
    names = []
    for chunk in model_chunks:
        for name, module in chunk.named_modules():
            if isinstance(module, ColumnParallelLinear):
                forward = _column_forward
            elif isinstance(module, RowParallelLinear):
                forward = _row_forward
            else:
                continue
            if module.tp_group is not None and dist.get_world_size(module.tp_group) > 1:
                raise ValueError(f"the te_like stand-in is for TP=1; {name} is tensor-parallel")
            module.forward = types.MethodType(forward, module)
            module.te_like_state = _KernelState(kind, honour_switch)
            module.is_first_microbatch = True
            setattr(module, SWITCH, module.config.disable_parameter_transpose_cache)
            names.append(name)
        chunk.config.quant_recipe = QUANTIZING
    return names

"""Megatron's combined forward-backward step under the weight stash, each node at its own version.

With Megatron's `--overlap-moe-expert-parallel-comm` a stage runs one microbatch's forward
beside another's backward through Megatron-Core's own combined step
(`combined_forward_backward_step`, pipeline_parallel/combined_1f1b.py). The forward step
returns the model's schedule plan (`GPTModel.build_schedule_plan`), which splits every layer
into nodes (attention and router, dispatch all-to-all, experts, combine all-to-all) that
`TransformerModelChunkSchedulePlan.run` interleaves with the other microbatch's nodes, the
all-to-alls on a communication stream (`set_streams`), so each all-to-all hides behind the
other microbatch's compute. Every node detaches its inputs and holds its own piece of the
autograd graph.

Under 2bw the two halves of a step may need different weight versions: the first forwards
of batch b+1 run beside backwards of batch b, at versions b and b-1 (one step with mixed
versions a slot at the batch edge; every slot on a stage whose warm-up is m forwards). So
this module wraps the nodes of each plan the forward step builds, and Megatron's step runs
as it is:

- before a node's forward or backward the stash points the parameters at that node's own
  microbatch's version (the pointer each kernel reads is taken when it is launched, so the
  other microbatch's nodes in between read theirs). Only the weights the node may read: a
  layer's nodes read their layer's and the weights outside every layer (the last layer's
  combine node applies the decoder's final norm), never another layer's; the pre- and
  post-process nodes read only those outside. So a switch costs a layer's parameters, not
  the stage's, several times a layer in every step;
- a forward node whose backward comes after an optimizer step runs under the stash's
  saved-tensor hooks, node by node, as a whole forward does otherwise;
- such a node's fused weight-gradient layers (stash/fused_wgrad.py) are found in its own
  graph, which ends at its detached inputs, and get DDP's dummy gradients right before that
  node's backward.

So no step has to run its halves apart: every ForwardBackward of the lists runs paired.
Every pass of such a run goes through the combined step, a lone forward (warm-up) or
backward (cool-down) with the other half empty, since a backward runs the plan its
forward built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from megatron_async.stash import fused_wgrad

# the nodes of one layer of Megatron's plan (TransformerLayerSchedulePlan), in forward order
LAYER_NODES = ("pre_dispatch_computation", "moe_dispatch", "mlp", "moe_combine", "mtp_post_process")


@dataclass
class ForwardHalf:
    """A forward of the step: microbatch `microbatch` at `version`, under the stash's hooks or not."""
    microbatch: int
    version: object
    hooks: bool
    input_tensor: Optional[torch.Tensor]  # None on the first stage
    data: Iterator  # what the forward step reads
    reports: list  # where Megatron's forward step appends the loss reports (last stage)
    microbatches: int  # a batch's


@dataclass
class BackwardHalf:
    """A backward of the step: the output of microbatch `microbatch`'s forward, at `version`."""
    microbatch: int
    version: object
    input_tensor: Optional[torch.Tensor]
    output: torch.Tensor  # carries the plan its forward built (Megatron's step reads it there)
    grad: Optional[torch.Tensor]  # None on the last stage (the loss)


class NodeAtVersion:
    """One node of a plan, run with the parameters at its microbatch's version."""

    def __init__(self, node, label: str, module: torch.nn.Module, microbatch: int, version, hooks: bool, stash,
                 reads: tuple):
        self.node, self.label, self.module = node, label, module
        self.microbatch, self.version, self.hooks, self.stash = microbatch, version, hooks, stash
        self.reads = reads  # the stash's positions of the weights it may read (module docstring)
        self.fused: list = []  # its fused weight-gradient layers' weights (hooked forwards only)
        self._forward, self._backward = node.forward_func, node.backward_func
        node.forward_func, node.backward_func = self.forward, self.backward

    def forward(self, *inputs):
        with self.stash.use(self.version, hooks=self.hooks, only=self.reads):
            outputs = self._forward(*inputs)
        if self.hooks:  # the graph of this node only: from its outputs to its detached inputs
            roots = list(outputs) if isinstance(outputs, tuple) else [outputs]
            self.fused = self.stash.fused_weights(roots + list(getattr(self.node, "before_detached", ())))
        return outputs

    def backward(self, outputs, output_grad):
        self.stash.point_to(self.version, self.reads)
        fused_wgrad.give_dummy_grads(self.fused)
        self.fused = []
        return self._backward(outputs, output_grad)


def plan_nodes(plan, model: torch.nn.Module) -> Iterator[tuple]:
    """(label, the module whose weights it reads, node) for every computing node of `plan`."""
    from megatron.core.pipeline_parallel.utils import ScheduleNode

    if plan.pre_process is not None:
        yield "pre_process", model, plan.pre_process
    for i in range(plan.num_layers()):
        layer = plan.get_layer(i)
        for name in LAYER_NODES:
            node = getattr(layer, name, None)
            if isinstance(node, ScheduleNode):  # not Megatron's no-op stand-ins (dense layers, no MTP)
                yield f"layer {getattr(layer.layer, 'layer_number', i)} {name}", layer.layer, node
    if plan.post_process is not None:
        yield "post_process", model, plan.post_process


class CombinedSteps:
    """Runs a stage's passes through Megatron's combined step (module docstring)."""

    def __init__(self, model, stash, forward_step_func: Callable, config):
        from megatron.core.pipeline_parallel.utils import set_streams

        self.model, self.stash, self.forward_step_func, self.config = model, stash, forward_step_func, config
        self._reads: dict = {}  # id(module) -> the stash's positions of the weights its nodes may read
        set_streams(high_priority=config.high_priority_a2a_comm_stream)

    def _weights_read(self, plan, model) -> dict:
        """id(module) -> what the nodes of `module` may read (module docstring): for a layer, its
        own weights and those outside every layer; for the model (pre- and post-process), those
        outside alone. The same modules in every plan: computed once."""
        if not self._reads:
            layers = [plan.get_layer(i).layer for i in range(plan.num_layers())]
            inside = {id(p) for layer in layers for p in layer.parameters()}
            outside = self.stash.indices_of(p for p in model.parameters() if id(p) not in inside)
            self._reads[id(model)] = outside
            for layer in layers:
                self._reads[id(layer)] = self.stash.indices_of(layer.parameters()) + outside
        return self._reads

    def _planning(self, half: ForwardHalf) -> Callable:
        """The forward step Megatron's combined step calls for `half`: the model's plan, its nodes
        wrapped to run at the half's version."""
        forward_step = self.forward_step_func

        def planned(data_iterator, model, return_schedule_plan=True):
            plan, loss_func = forward_step(data_iterator, model, return_schedule_plan=return_schedule_plan)
            reads = self._weights_read(plan, model)
            for label, module, node in plan_nodes(plan, model):
                NodeAtVersion(node, label, module, half.microbatch, half.version, half.hooks, self.stash,
                              reads[id(module)])
            return plan, loss_func

        return planned

    def step(self, forward: Optional[ForwardHalf], backward: Optional[BackwardHalf]) -> tuple:
        """Run `forward` beside `backward` (either may be None); returns (the forward's output,
        the backward's input gradient)."""
        from megatron.core.pipeline_parallel.combined_1f1b import combined_forward_backward_step

        f_model = self.model if forward is not None else None
        b_model = self.model if backward is not None else None
        m = forward.microbatches if forward is not None else 1
        output, _tokens, input_grad = combined_forward_backward_step(
            self._planning(forward) if forward is not None else None,
            forward.data if forward is not None else None,
            f_model, m,
            forward.input_tensor if forward is not None else None,
            forward.reports if forward is not None else [],
            b_model,
            backward.input_tensor if backward is not None else None,
            backward.output if backward is not None else None,
            backward.grad if backward is not None else None,
            self.config,
            is_first_microbatch=forward is not None and forward.microbatch % m == 0,
            current_microbatch=forward.microbatch % m if forward is not None else None,
        )
        return output, input_grad

"""Executes one stage's action list (from a schedule generator) on a Megatron model.

The executor is a loop over actions: Forward/Backward run the stage's module at the
action's weight version (through the WeightStashManager), ForwardBackward runs one
microbatch's forward beside another's backward through Megatron's combined step, each
node at its own microbatch's version (combined_step.py; with Megatron's
--overlap-moe-expert-parallel-comm every pass goes through it), OptimizerStep calls its
owner's `optimizer_step` (StageEvents: the gradient sync, and the optimizer step unless
Megatron's training loop steps the optimizer itself), and runs of
communication actions are posted together over point-to-point links. Pipeline
state (activations in flight, pending sends) persists between training steps:
`train_step(t)` runs actions up to this stage's OptimizerStep(t) and stops, so the
next batch's warm-up forwards that precede it have already run.

Nothing here communicates across pipeline stages except the point-to-point
transfers the schedule lists. Every `train_step(t)` ends by receiving the
activations the previous stage has already sent for later batches (its warm-up
forwards of batch t+1): on NCCL a large send runs on the sender's GPU until its
receiver posts, and Megatron's step-end code (timers, `torch.cuda.synchronize`,
`empty_cache`, all-rank barriers) would otherwise wait on a send whose receive is
only posted in the receiver's next step, behind the same barrier: a hang. These
early receives are kept and not posted again. `drain()` then only waits for this
stage's own sends (before a save, an evaluation or an exit).
"""

from __future__ import annotations

import collections
import contextlib
from typing import Callable, Iterable, Iterator, Optional

from megatron.core.pipeline_parallel import schedules
from megatron.core.utils import get_model_config

from megatron_async.pipeline.combined_step import BackwardHalf, CombinedSteps, ForwardHalf
from megatron_async.pipeline.p2p import PendingSends, post_run
from megatron_async.pipeline.stage_context import StageContext
from megatron_async.schedules.actions import (Backward, Forward, ForwardBackward, OptimizerStep, RecvActivation,
                                              ScheduleError, SendActivation, is_comm)
from megatron_async.stash import fused_wgrad

DataFor = Callable[[int], Iterator]  # microbatch index -> the iterator Megatron's forward step reads


class StageEvents:
    """What the owner of a training executor does at its points (the 2bw runner)."""

    def optimizer_step(self, step: int):
        """At OptimizerStep(step): gradient sync, and the step or nothing (Megatron steps next)."""
        raise NotImplementedError

    def batch_started(self, batch: int) -> None:
        """Before this stage's first forward of `batch` (e.g. an RNG snapshot)."""

    def batch_sent(self, batch: int) -> None:
        """Once this stage posted the send of `batch`'s last activation."""

    def live_forward(self) -> None:
        """Before a forward that reads the live weights (its version is the newest)."""


def _no_data(k: int) -> Iterator:
    raise ScheduleError(f"a forward of microbatch {k} where the executor was given no data (finish runs sends only)")


class StageExecutor:
    """Runs a stage's actions for a whole training run, one optimizer step at a time."""

    def __init__(self, context: StageContext, actions: Iterable, events: Optional[StageEvents], stream=None):
        """`actions`: this stage's list, consumed as it runs (a lazy stream for long runs).
        `events`: the owner a training run calls at its optimizer steps and batch edges.
        `stream` (a TwoBWStream): the run's first and last step and the previous stage's
        segments, read by `train_step` and `finish`."""
        model, links = context.model, context.links
        self.context = context
        self.model = model
        self.actions = iter(actions)
        self._lookahead: collections.deque = collections.deque()
        self.stream = stream
        self.final_step = stream.first + stream.n - 1 if stream is not None else None  # the run's last step
        self.last_step: Optional[int] = None  # the last OptimizerStep run
        self.first_step = stream.first if stream is not None else 0  # a resumed run starts later
        self.events = events
        self.forwards = 0
        self.links = links
        self.stash = context.stash
        self.m = context.num_microbatches
        self.shape = context.activation_shape
        self.dtype = context.dtype
        self.device = context.device
        self.is_first = links.stage == 0
        self.is_last = links.stage == links.num_stages - 1
        self.config = get_model_config(model)
        self.cp_size = context.groups.cp.size()
        self._received: dict = {}
        self._outgoing: dict = {}
        self._inflight: dict = {}  # microbatch -> (input tensor, output tensor or loss)
        self._reports: dict = {}  # batch -> list of loss reports
        self._drained: set = set()  # microbatches whose activation drain() received early
        self._fused: dict = {}  # hooked microbatch -> its fused weights (stash/fused_wgrad.py)
        self.pending_sends = PendingSends(self.m)
        self.combined = self._combined_steps(context)

    def _combined_steps(self, context: StageContext) -> Optional[CombinedSteps]:
        """With --overlap-moe-expert-parallel-comm: every pass through Megatron's combined step
        (combined_step.py); None: each pass through its forward and backward steps."""
        if not context.combined_steps:
            return None
        return CombinedSteps(self.model, self.stash, context.forward_step_func, self.config)

    # --- compute ---------------------------------------------------------------
    # Megatron's own per-microbatch steps (megatron.core.pipeline_parallel.schedules),
    # as its 1F1B calls them: loss normalisation, the MoE auxiliary-loss and MTP loss
    # scales, autocast, grad scaling, freeing a sent output's data. Only the weight
    # version around them is ours.
    def _forward_half(self, action: Forward, data_for: DataFor) -> ForwardHalf:
        """A forward's inputs, taken from what the stage received, and the batch-edge event."""
        k = action.microbatch
        self.forwards += 1
        if k % self.m == 0:
            self._batch_started(k // self.m)
        self._before_forward_at(action.version)
        input_tensor = None
        if not self.is_first:
            input_tensor = self._received.pop(("act", k)).requires_grad_()
        # The stash's saved-tensor hooks only where an optimizer step falls between this
        # forward and its backward, and on the run's first microbatch (k = 0), so an alias
        # guard fires at once. By the microbatch's index, not this process's first forward:
        # a resumed run then hooks exactly the forwards the uninterrupted run hooked (with
        # tied embeddings and MTP a hooked forward's backward rounds differently).
        hooks = self._hooked(k)
        return ForwardHalf(k, action.version, hooks, input_tensor, data_for(k),
                           self._reports.setdefault(k // self.m, []), self.m)

    def _batch_started(self, batch: int) -> None:
        self.events.batch_started(batch)

    def _before_forward_at(self, version: int) -> None:
        if version == self.stash.newest:  # it reads the live weights
            self.events.live_forward()

    def _hooked(self, k: int) -> bool:
        return k // self.m > self.next_step or k == 0

    def _forward_done(self, half: ForwardHalf, output) -> None:
        if not self.is_last:
            self._outgoing[("act", half.microbatch)] = output.detach()
            # keeps only the autograd graph; the sent copy's storage lives until its send retires
            schedules.deallocate_output_tensor(output, self.config.deallocate_pipeline_outputs)
        self._keep_for_backward(half, output)

    def _keep_for_backward(self, half: ForwardHalf, output) -> None:
        self._inflight[half.microbatch] = (half.input_tensor, output)

    def _forward(self, action: Forward, data_for: DataFor) -> None:
        half = self._forward_half(action, data_for)
        if self.combined is not None:  # its backward runs the plan this forward builds
            output, _ = self.combined.step(half, None)
            self._forward_done(half, output)
            return
        k = half.microbatch
        with self.stash.use(half.version, hooks=half.hooks):
            output, _ = schedules.forward_step(
                self.context.forward_step_func, half.data, self.model, self.m, half.input_tensor, half.reports,
                self.config, self.cp_size, is_first_microbatch=k % self.m == 0, current_microbatch=k % self.m,
                is_last_stage=self.is_last)
        if half.hooks:  # its backward sees plain tensors for the Parameters (stash/fused_wgrad.py)
            self._fused[k] = self.stash.fused_weights(output)
        self._forward_done(half, output)

    def _backward_half(self, action: Backward) -> BackwardHalf:
        k = action.microbatch
        input_tensor, output = self._inflight.pop(k)
        grad = None if self.is_last else self._received.pop(("grad", k))
        return BackwardHalf(k, action.version, input_tensor, output, grad)

    def _reduces_after(self, half: BackwardHalf):
        """DDP reduces gradients only after the batch's last backward: no_sync before it."""
        last_of_batch = half.microbatch % self.m == self.m - 1
        return contextlib.nullcontext() if last_of_batch else self.model.no_sync()

    def _backward_done(self, half: BackwardHalf, input_grad) -> None:
        if not self.is_first:
            self._outgoing[("grad", half.microbatch)] = input_grad

    def _backward(self, action: Backward) -> None:
        half = self._backward_half(action)
        with self._reduces_after(half):
            if self.combined is not None:
                _, input_grad = self.combined.step(None, half)
            else:
                fused_wgrad.give_dummy_grads(self._fused.pop(half.microbatch, ()))
                self.stash.point_to(half.version)
                input_grad = schedules.backward_step(half.input_tensor, half.output, half.grad, self.config)
        self._backward_done(half, input_grad)

    def _forward_backward(self, action: ForwardBackward, data_for: DataFor) -> None:
        """One combined step: the forward beside the backward, each node at its own
        microbatch's version (combined_step.py)."""
        if self.combined is None:
            raise ScheduleError(f"stage {self.links.stage}: {action!r} is a combined step, which runs only with "
                                "--overlap-moe-expert-parallel-comm (Megatron's combined forward-backward step)")
        forward = self._forward_half(action.forward, data_for)
        backward = self._backward_half(action.backward)
        with self._reduces_after(backward):
            output, input_grad = self.combined.step(forward, backward)
        self._forward_done(forward, output)
        self._backward_done(backward, input_grad)

    @property
    def next_step(self) -> int:
        """The next OptimizerStep this stage runs: it applies batch `next_step`."""
        return self.first_step if self.last_step is None else self.last_step + 1

    def _optimizer_step(self, action: OptimizerStep):
        return self.events.optimizer_step(action.step)

    def _batch_sent(self, run: list) -> None:
        for a in run:
            if isinstance(a, SendActivation) and a.microbatch % self.m == self.m - 1:
                self.events.batch_sent(a.microbatch // self.m)

    # --- driver ----------------------------------------------------------------
    def _peek(self):
        if not self._lookahead:
            action = next(self.actions, None)
            if action is None:
                return None
            self._lookahead.append(action)
        return self._lookahead[0]

    def _comm_run(self) -> list:
        """The communication actions up to the next compute action or the end, less the
        receives `drain()` has already completed."""
        run = []
        while (action := self._peek()) is not None and is_comm(action):
            action = self._lookahead.popleft()
            if isinstance(action, RecvActivation) and action.microbatch in self._drained:
                self._drained.discard(action.microbatch)  # drain() received it already
                continue
            run.append(action)
        return run

    def _run_until(self, stop: Optional[int], data_for: DataFor) -> tuple[bool, object]:
        """Run actions until OptimizerStep(stop) has run (or to the end if stop is None),
        forwards reading `data_for(k)`; returns (whether it was found, the step's result)."""
        while (action := self._peek()) is not None:
            if is_comm(action):
                run = self._comm_run()
                received, sends = post_run(run, self.links, self._outgoing, self.shape, self.dtype, self.device)
                self._received.update(received)
                self.pending_sends.add(sends)
                self._batch_sent(run)
                continue
            if getattr(action, "chunk", 0) != 0:  # this stage holds one piece of the model, chunk 0
                raise ScheduleError(f"stage {self.links.stage}: {action!r} runs model chunk {action.chunk}, "
                                    "but this stage holds one chunk (0): an interleaved list needs a virtual "
                                    "pipeline, which 2bw does not run")
            match action:  # any other compute action stops the run (a split backward must not be skipped)
                case Forward():
                    self._lookahead.popleft()
                    self._forward(action, data_for)
                case Backward():
                    self._lookahead.popleft()
                    self._backward(action)
                case ForwardBackward():
                    self._lookahead.popleft()
                    self._forward_backward(action, data_for)
                case OptimizerStep():
                    self._lookahead.popleft()
                    result = self._step_and_retire(action)
                    if stop is not None and action.step == stop:
                        return True, result
                case _:
                    raise ScheduleError(f"stage {self.links.stage}: the executor cannot run {action!r} "
                                        f"({type(action).__name__}); it runs Forward, Backward, ForwardBackward, "
                                        "OptimizerStep and point-to-point actions")
        return False, None

    def _step_and_retire(self, action: OptimizerStep):
        result = self._optimizer_step(action)
        self.last_step = action.step
        self.pending_sends.retire_through(action.step - 1)
        return result

    def batch_reports(self, step: int) -> list:
        """The loss reports of batch `step` so far (all of them once its last forward ran)."""
        return self._reports.get(step, [])

    def train_step(self, step: int, data_for: DataFor) -> tuple[list, tuple]:
        """Run up to and including this stage's optimizer step `step`, forwards reading
        `data_for(k)` (warm-up forwards of later batches too).

        Returns (loss reports of batch `step` on the last stage, optimizer result).
        """
        found, result = self._run_until(step, data_for)
        if not found:
            raise RuntimeError(f"stage {self.links.stage}: no OptimizerStep({step}) left in its schedule")
        self._receive_sent_ahead()
        return self._reports.pop(step, []), result

    def _receive_sent_ahead(self) -> None:
        """Receive what the previous stage sent before its OptimizerStep(t) for later batches.

        Each stage stops right after its OptimizerStep(t). The previous stage has
        already sent (or is about to send, before its own OptimizerStep(t))
        activations of batch t+1's warm-up forwards that this stage's list receives
        only after its OptimizerStep(t): one per stage pair in the steady state.
        Receiving them here, before control returns to Megatron, means no send
        posted in a stage's step t waits on its receiver's step t+1, so a
        whole-device wait or an all-rank collective at any step end cannot hang.
        The previous stage posts them without waiting on anything this stage does
        after its step, so this never deadlocks; on each link they are the next
        operations in order, so NCCL's per-link order is kept
        (schedules/link_order.py `check_step_ends`). They are kept for their
        forwards, whose receives are then not posted again.
        """
        if self.last_step is None or self.stream is None or self.is_first:
            return
        first_next = (self.last_step + 1) * self.m  # batch last_step + 1's first microbatch
        received = {k for kind, k in self._received if kind == "act"} | set(self._inflight) | self._drained
        previous = self.stream.segment(self.links.stage - 1, self.last_step - self.stream.first)
        missing = [RecvActivation(a.microbatch, self.links.stage - 1) for a in previous
                   if isinstance(a, SendActivation) and a.microbatch >= first_next and a.microbatch not in received]
        if missing:
            got, _ = post_run(missing, self.links, {}, self.shape, self.dtype, self.device)
            self._received.update(got)
            self._drained.update(a.microbatch for a in missing)

    def drain(self) -> None:
        """Match every send still outstanding, between two training steps.

        `train_step` has already received what the previous stage sent ahead
        (`_receive_sent_ahead`), so this waits for this stage's own sends: the next
        stage has received them, or receives them before its own step ends without
        waiting on this stage. Call it on every stage of the pipeline, or on none.
        """
        self.pending_sends.wait_all()

    def finish(self) -> None:
        """Leave the pipeline clean without training any further batch.

        At the run's last step only the trailing actions (sends) are left: run them.
        When training stops earlier (`--exit-interval`), drain: an unmatched send can
        hold NCCL at exit; what the drain receives is never used.
        """
        if self.last_step is not None and self.last_step == self.final_step:
            self._run_until(None, _no_data)
        self.drain()


class ForwardOnlyExecutor(StageExecutor):
    """An evaluation pass: a forward-only list (schedules/gen_forward_only.py) at one weight
    version, run to its end between two training steps. No backward follows, so no
    activation is kept, no saved-tensor hook is set and no owner is told of batch edges; a
    backward or an optimizer step in its list stops it."""

    def __init__(self, context: StageContext, actions: Iterable):
        super().__init__(context, actions, None)

    def run(self, data_for: DataFor) -> list:
        """Run the list to its end and wait for its sends; the loss reports (last stage) of
        its microbatches, in order."""
        self._run_until(None, data_for)
        self.drain()
        return [report for batch in sorted(self._reports) for report in self._reports[batch]]

    def _combined_steps(self, context: StageContext) -> None:
        return None

    def _batch_started(self, batch: int) -> None:
        pass

    def _before_forward_at(self, version: int) -> None:
        pass  # an evaluation runs after the training links are drained: the live weights are the newest

    def _batch_sent(self, run: list) -> None:
        pass

    def _hooked(self, k: int) -> bool:
        return False

    def _keep_for_backward(self, half: ForwardHalf, output) -> None:
        pass

    def _refuse(self, action) -> None:
        raise ScheduleError(f"stage {self.links.stage}: {action!r} in a forward-only pass")

    def _backward(self, action: Backward) -> None:
        self._refuse(action)

    def _forward_backward(self, action: ForwardBackward, data_for: DataFor) -> None:
        self._refuse(action)

    def _optimizer_step(self, action: OptimizerStep):
        self._refuse(action)

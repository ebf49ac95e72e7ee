"""Point-to-point buffers a 2bw stage holds, counted by replaying its action stream.

Under 2bw a stage keeps every tensor it sends alive (pipeline/p2p.py, PendingSends)
until after its OptimizerStep(t), when the sends of batch t-1 and earlier retire.
How many are held at once depends on the exact interleaving of forwards, backwards,
sends and steps on each stage, so the plan does not guess a formula: it replays the
stream the runtime executes (schedules/stream_2bw.TwoBWStream) through PendingSends
itself, with the executor's retirement call, and takes the peak after every action.

Besides the held sends the executor briefly holds an output its compute produced and
the next communication run has not posted yet, and a received tensor waiting for the
compute action that consumes it; both are counted in `buffers`. A received activation,
once its forward has run, is the first layer's input, which the plan's activation
estimate already counts as saved for the backward; it is not counted again here.

The replay follows the training stream only. A drain before a save or an evaluation
(StageExecutor.drain) waits out and drops every held send; it receives early the
activations the previous stage already sent for the next batch's warm-up.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_async.pipeline.p2p import PendingSends
from megatron_async.schedules.actions import (Backward, Forward, ForwardBackward, OptimizerStep, RecvActivation,
                                              RecvGrad, SendActivation, SendGrad, passes)
from megatron_async.schedules.stream_2bw import TEMPLATE_BATCHES, TwoBWStream

RETIRE_LAG = 1  # the executor calls pending_sends.retire_through(step - 1) after OptimizerStep(step)
# Held sends after OptimizerStep(t) belong to batches t and t+1 only, so the state repeats
# from the third batch on; these batches cover the stream's head, its relabelled steady
# segments and its last segment.
REPLAY_BATCHES = TEMPLATE_BATCHES + 3


@dataclass(frozen=True)
class P2PPeak:
    """Peak counts of one stage's point-to-point tensors (each of the activation shape)."""

    act_sends: int  # activations sent downstream and still held
    grad_sends: int  # input gradients sent upstream and still held
    sends: int  # both together, at the moment their sum peaks
    buffers: int  # held sends + outputs not yet posted + receives not yet consumed, at their peak


class _Posted:
    """Stands for a send's work object: the replay's sends complete at once."""

    def wait(self) -> None:
        pass

    def is_completed(self) -> bool:
        """Never known complete before its retirement: the plan budgets for sends that
        are still on the wire (gloo's case; NCCL may retire them earlier)."""
        return False


class _TimedSend(_Posted):
    """A send that reports completion once its receive has ended (NCCL's `is_completed`)."""

    def __init__(self, received_at: float, clock: list):
        self.received_at, self.clock = received_at, clock

    def is_completed(self) -> bool:
        return self.received_at <= self.clock[0]


def replay(actions, num_microbatches: int, first: bool, last: bool, retire_lag: int = RETIRE_LAG,
           posted=None) -> P2PPeak:
    """Peaks of `actions` (one stage's list) as the executor runs them: sends held in
    a PendingSends per direction, retired through batch t - `retire_lag` after
    OptimizerStep(t); counted after every action. `posted(index, action)` gives a
    send's work object (by default one never complete before its retirement)."""
    posted = posted or (lambda _index, _action: _Posted())
    held = {"act": PendingSends(num_microbatches), "grad": PendingSends(num_microbatches)}
    outgoing: set = set()  # (kind, microbatch) produced, not yet posted
    received: set = set()  # (kind, microbatch) received, not yet consumed
    peak = {"act": 0, "grad": 0, "sends": 0, "buffers": 0}
    for index, action in enumerate(actions):
        if isinstance(action, (Forward, Backward, ForwardBackward)):
            for pass_ in passes(action):  # a combined step consumes and produces both passes' tensors
                kind, sends = ("act", not last) if isinstance(pass_, Forward) else ("grad", not first)
                received.discard((kind, pass_.microbatch))
                if sends:
                    outgoing.add((kind, pass_.microbatch))
        elif isinstance(action, (SendActivation, SendGrad)):
            kind = "act" if isinstance(action, SendActivation) else "grad"
            outgoing.remove((kind, action.microbatch))
            held[kind].add([(action.microbatch, posted(index, action), None)])
        elif isinstance(action, (RecvActivation, RecvGrad)):
            received.add(("act" if isinstance(action, RecvActivation) else "grad", action.microbatch))
        elif isinstance(action, OptimizerStep):
            for sends in held.values():
                sends.retire_through(action.step - retire_lag)
        else:
            raise TypeError(f"2bw lists hold no {type(action).__name__}")
        sends = len(held["act"]) + len(held["grad"])
        peak["act"] = max(peak["act"], len(held["act"]))
        peak["grad"] = max(peak["grad"], len(held["grad"]))
        peak["sends"] = max(peak["sends"], sends)
        peak["buffers"] = max(peak["buffers"], sends + len(outgoing) + len(received))
    return P2PPeak(peak["act"], peak["grad"], peak["sends"], peak["buffers"])


def stage_peaks(num_stages: int, num_microbatches: int, batches: int = REPLAY_BATCHES,
                retire_lag: int = RETIRE_LAG, paired: bool = False) -> list[P2PPeak]:
    """One P2PPeak per stage of a 2bw pipeline, over a run of `batches` batches (`paired`:
    the lists with combined forward-backward steps)."""
    stream = TwoBWStream(num_stages, num_microbatches, batches, paired=paired)
    return [replay(stream.actions(s), num_microbatches, s == 0, s == num_stages - 1, retire_lag)
            for s in range(num_stages)]


def stage_peaks_on_completion(num_stages: int, num_microbatches: int, batches: int = REPLAY_BATCHES,
                              fwd: float = 1.0, bwd: float = 2.0, paired: bool = False) -> list[P2PPeak]:
    """The peaks when a send retires as soon as it is known complete (NCCL: once its
    receive has ended; PendingSends.add drops it at this stage's next post), timed by
    the schedule simulator with forward and backward costs `fwd` and `bwd`.

    Timing-dependent (a slow receiver keeps sends held longer), so the plan budgets
    for `stage_peaks`, the bound that holds whatever the timing; this is what a
    balanced NCCL pipeline is expected to hold."""
    from megatron_async.schedules.actions import is_comm, is_send, placement_of, tensor_key
    from megatron_async.schedules.simulator import simulate

    lists = TwoBWStream(num_stages, num_microbatches, batches, paired=paired).lists()
    ends = simulate(lists, fwd=fwd, bwd=bwd).action_ends
    placement = placement_of(lists)
    received_at = {tensor_key(a, s, placement): ends[s][i] for s, acts in enumerate(lists)
                   for i, a in enumerate(acts) if is_comm(a) and not is_send(a)}
    peaks = []
    for s, acts in enumerate(lists):
        clock = [0.0]

        def posted(index, action, s=s, clock=clock):
            clock[0] = ends[s][index]  # the send's run has ended: PendingSends.add prunes now
            return _TimedSend(received_at[tensor_key(action, s, placement)], clock)

        peaks.append(replay(acts, num_microbatches, s == 0, s == num_stages - 1, posted=posted))
    return peaks


def activation_tensor_bytes(args) -> int:
    """Bytes of one tensor a stage sends (its output, or the gradient of its input):
    the sequence split over context-parallel ranks, and over tensor-parallel ranks with
    sequence parallelism, x micro batch x hidden, in the pipeline's dtype (Megatron's
    pipeline_dtype is params_dtype)."""
    seq = args.seq_length // args.context_parallel_size
    if args.sequence_parallel:
        seq //= args.tensor_model_parallel_size
    return seq * args.micro_batch_size * args.hidden_size * args.params_dtype.itemsize

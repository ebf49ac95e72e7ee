"""Pipeline schedules as data: the actions one pipeline stage performs, in order.

A schedule is a list with one entry per stage; each entry is the ordered list of
actions that stage runs. Compute actions carry the weight version they use, so a
runtime never has to infer which stashed weights belong to which microbatch:

- `Forward(microbatch, version)` and `Backward(microbatch, version)`; `microbatch`
  is a global index over the whole run (batch `b = microbatch // m` for `m`
  microbatches per batch), `version` is the weights after that many optimizer steps.
- `OptimizerStep(step)` applies the gradients accumulated by the stage's backwards
  since its previous step; step `t` turns version `t` into version `t + 1`.

A combined step runs one microbatch's forward beside another's backward
(Megatron's combined 1F1B, `--overlap-moe-expert-parallel-comm`), so each pass's expert
all-to-all can hide behind the other's compute: `ForwardBackward(forward, backward)`
holds the two passes, each with its own microbatch and weight version. It needs both
passes' receives before it and produces both passes' sends after it: neither tensor
leaves the stage before the whole step ends.

Zero-bubble schedules split a backward in two: `BackwardInput` computes the
gradient the previous stage waits for, `BackwardWeight` the weight gradients, which
can wait to fill a bubble; `Backward` is both at once.

Model chunks. A stage (a pipeline rank) may hold several pieces of the model
(interleaved 1F1B, ZB-V); every compute and communication action names its local
`chunk` (0 when a stage holds one piece), and a `Placement` says which (stage,
chunk) holds which piece, in model order. A schedule that is not a plain one-chunk
pipeline is an `ActionLists` carrying its placement.

Communication is explicit in the lists, not implied: `SendActivation`/`RecvActivation`
move a forward output to the stage holding the next piece of the model,
`SendGrad`/`RecvGrad` move the input gradient back; `peer` is the other stage and
`chunk` the local piece that produced or consumes the tensor (two neighbouring
pieces on one stage hand over without communication). Explicit actions let
the validator prove the order deadlock-free and let the executor stay a dumb loop.

Executor contract. Communication actions that stand next to each other (no compute
action between them) form a *run*. The generators order every run so that the lists
are deadlock-free under the strictest reading, one blocking send or receive at a
time that returns only once its peer posted the matching operation (rendezvous);
`validate` checks exactly that. An executor may therefore either run the actions
one by one with blocking `send`/`recv`, or post a whole run at once (one
`batch_isend_irecv`, or isend/irecv per action) and wait for all of it before the
next compute action: posting earlier never removes a match. Messages between two
stages are matched in posting order (FIFO per direction, no tags needed); the
`microbatch` fields let the executor assert it received what it expected.
The simulator models the second form (a run posted together, sends not blocking).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Optional, Sequence, Union


class ScheduleError(ValueError):
    """A schedule that is wrong; the message names the stage, action index and fault
    (raised by the validator and the link-order check)."""


class _Repr:
    """repr without `chunk` when it is 0: most schedules hold one chunk a stage, and their actions read shorter."""

    def __repr__(self) -> str:
        fields = [f"{k}={v!r}" for k, v in self.__dict__.items() if not (k == "chunk" and v == 0)]
        return f"{type(self).__name__}({', '.join(fields)})"


def _c(chunk: int) -> str:
    return f"c{chunk}" if chunk else ""


@dataclass(frozen=True, repr=False)
class Forward(_Repr):
    microbatch: int
    version: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"F{self.microbatch}v{self.version}{_c(self.chunk)}"


@dataclass(frozen=True, repr=False)
class Backward(_Repr):
    """Input and weight gradients of one microbatch, in one pass."""
    microbatch: int
    version: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"B{self.microbatch}v{self.version}{_c(self.chunk)}"


@dataclass(frozen=True, repr=False)
class BackwardInput(_Repr):
    """The input gradient only (what the previous piece waits for)."""
    microbatch: int
    version: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"I{self.microbatch}v{self.version}{_c(self.chunk)}"


@dataclass(frozen=True, repr=False)
class BackwardWeight(_Repr):
    """The weight gradients of a microbatch whose BackwardInput already ran."""
    microbatch: int
    version: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"W{self.microbatch}v{self.version}{_c(self.chunk)}"


@dataclass(frozen=True, repr=False)
class ForwardBackward(_Repr):
    """One combined step: `forward` of one microbatch beside `backward` of another. The
    backward's own forward ran before the step, so the two passes do not depend on
    each other and can overlap; both results exist only when the step ends."""
    forward: Forward
    backward: Backward

    def __str__(self) -> str:
        return f"[{self.forward}+{self.backward}]"


@dataclass(frozen=True, repr=False)
class OptimizerStep(_Repr):
    step: int  # applies to version `step`, produces version `step + 1`

    @property
    def produces(self) -> int:
        return self.step + 1

    def __str__(self) -> str:
        return f"OPT{self.step}"


@dataclass(frozen=True, repr=False)
class SendActivation(_Repr):
    microbatch: int
    peer: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"SA{self.microbatch}{_c(self.chunk)}>{self.peer}"


@dataclass(frozen=True, repr=False)
class RecvActivation(_Repr):
    microbatch: int
    peer: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"RA{self.microbatch}{_c(self.chunk)}<{self.peer}"


@dataclass(frozen=True, repr=False)
class SendGrad(_Repr):
    microbatch: int
    peer: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"SG{self.microbatch}{_c(self.chunk)}>{self.peer}"


@dataclass(frozen=True, repr=False)
class RecvGrad(_Repr):
    microbatch: int
    peer: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"RG{self.microbatch}{_c(self.chunk)}<{self.peer}"


Compute = Union[Forward, Backward, BackwardInput, BackwardWeight, ForwardBackward, OptimizerStep]
Comm = Union[SendActivation, RecvActivation, SendGrad, RecvGrad]
Action = Union[Compute, Comm]
Schedule = Sequence[Sequence[Action]]

COMPUTE_TYPES = (Forward, Backward, BackwardInput, BackwardWeight, ForwardBackward, OptimizerStep)
PASS_TYPES = (Forward, Backward, BackwardInput, BackwardWeight)  # compute with a microbatch and version
COMM_TYPES = (SendActivation, RecvActivation, SendGrad, RecvGrad)
SEND_TYPES = (SendActivation, SendGrad)

# The receive that matches each send, and back.
MATCHING = {
    SendActivation: RecvActivation,
    RecvActivation: SendActivation,
    SendGrad: RecvGrad,
    RecvGrad: SendGrad,
}


@dataclass(frozen=True)
class Placement:
    """Which (stage, chunk) holds each piece of the model, in model order: piece 0
    takes the tokens, the last piece computes the loss."""
    num_stages: int
    order: tuple  # of (stage, chunk), one per piece

    @classmethod
    def linear(cls, num_stages: int) -> "Placement":
        """One piece per stage, stage s holds piece s (1F1B, 2BW, ZB-H1)."""
        return cls(num_stages, tuple((s, 0) for s in range(num_stages)))

    @classmethod
    def interleaved(cls, num_stages: int, chunks: int) -> "Placement":
        """Megatron's virtual stages: piece c*p + s on stage s, chunk c."""
        return cls(num_stages, tuple((s, c) for c in range(chunks) for s in range(num_stages)))

    @classmethod
    def vee(cls, num_stages: int) -> "Placement":
        """ZB-V: down the stages with chunk 0, back up with chunk 1; stage 0 holds the
        first and the last piece."""
        down = [(s, 0) for s in range(num_stages)]
        return cls(num_stages, tuple(down + [(s, 1) for s in reversed(range(num_stages))]))

    @property
    def num_pieces(self) -> int:
        return len(self.order)

    @property
    def chunks_per_stage(self) -> int:
        return self.num_pieces // self.num_stages

    def piece(self, stage: int, chunk: int) -> int:
        return self._index[(stage, chunk)]

    def holder(self, piece: int) -> Optional[tuple]:
        """(stage, chunk) of `piece`, None outside the model."""
        return self.order[piece] if 0 <= piece < len(self.order) else None

    @cached_property
    def _index(self) -> dict:
        return {sc: i for i, sc in enumerate(self.order)}


class ActionLists(list):
    """Per-stage action lists that carry their placement, and whether they need
    buffered sends (a send completes when posted) to be deadlock-free."""

    def __init__(self, lists, placement: Placement, buffered_sends: bool = False):
        super().__init__(lists)
        self.placement = placement
        self.buffered_sends = buffered_sends


def placement_of(schedule: Schedule) -> Placement:
    """The schedule's own placement, or one piece per stage."""
    return getattr(schedule, "placement", None) or Placement.linear(len(schedule))


def tensor_key(action: Comm, stage: int, placement: Placement) -> tuple:
    """What a send and its receive share: (kind, the sending piece, microbatch)."""
    piece = placement.piece(stage, action.chunk)
    if isinstance(action, SendActivation):
        return "act", piece, action.microbatch
    if isinstance(action, RecvActivation):
        return "act", piece - 1, action.microbatch
    if isinstance(action, SendGrad):
        return "grad", piece, action.microbatch
    return "grad", piece + 1, action.microbatch


def passes(action: Action) -> tuple:
    """The passes (PASS_TYPES) a compute action runs: itself, a combined step's forward
    and backward, none for an optimizer step or a transfer."""
    if isinstance(action, ForwardBackward):
        return action.forward, action.backward
    return (action,) if isinstance(action, PASS_TYPES) else ()


def is_comm(action: Action) -> bool:
    return isinstance(action, COMM_TYPES)


def is_send(action: Action) -> bool:
    return isinstance(action, SEND_TYPES)


def matches(action: Comm, stage: int, other: Action, other_stage: int) -> bool:
    """True if `other` at `other_stage` is the counterpart of `action` at `stage`
    (same channel and direction; the microbatch is checked separately)."""
    return (
        type(other) is MATCHING[type(action)]
        and action.peer == other_stage
        and other.peer == stage
    )


def format_schedule(schedule: Schedule) -> str:
    """One line per stage, compact action names; for debugging and docs."""
    return "\n".join(f"stage {s}: " + " ".join(map(str, acts)) for s, acts in enumerate(schedule))

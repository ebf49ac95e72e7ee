"""Pipeline schedules as data: the actions one pipeline stage performs, in order.

A schedule is a list with one entry per stage; each entry is the ordered list of
actions that stage runs. Compute actions carry the weight version they use, so a
runtime never has to infer which stashed weights belong to which microbatch:

- `Forward(microbatch, version)` and `Backward(microbatch, version)`; `microbatch`
  is a global index over the whole run (batch `b = microbatch // m` for `m`
  microbatches per batch), `version` is the weights after that many optimizer steps.
- `OptimizerStep(step)` applies the gradients accumulated by the stage's backwards
  since its previous step; step `t` turns version `t` into version `t + 1`.

Communication is explicit in the lists, not implied: `SendActivation`/`RecvActivation`
move a forward output from stage s to s+1, `SendGrad`/`RecvGrad` move the input
gradient from stage s+1 back to s; `peer` is the other stage. Explicit actions let
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
from typing import Sequence, Union


@dataclass(frozen=True)
class Forward:
    microbatch: int
    version: int

    def __str__(self) -> str:
        return f"F{self.microbatch}v{self.version}"


@dataclass(frozen=True)
class Backward:
    microbatch: int
    version: int

    def __str__(self) -> str:
        return f"B{self.microbatch}v{self.version}"


@dataclass(frozen=True)
class OptimizerStep:
    step: int  # applies to version `step`, produces version `step + 1`

    @property
    def produces(self) -> int:
        return self.step + 1

    def __str__(self) -> str:
        return f"OPT{self.step}"


@dataclass(frozen=True)
class SendActivation:
    microbatch: int
    peer: int  # always stage + 1

    def __str__(self) -> str:
        return f"SA{self.microbatch}>{self.peer}"


@dataclass(frozen=True)
class RecvActivation:
    microbatch: int
    peer: int  # always stage - 1

    def __str__(self) -> str:
        return f"RA{self.microbatch}<{self.peer}"


@dataclass(frozen=True)
class SendGrad:
    microbatch: int
    peer: int  # always stage - 1

    def __str__(self) -> str:
        return f"SG{self.microbatch}>{self.peer}"


@dataclass(frozen=True)
class RecvGrad:
    microbatch: int
    peer: int  # always stage + 1

    def __str__(self) -> str:
        return f"RG{self.microbatch}<{self.peer}"


Compute = Union[Forward, Backward, OptimizerStep]
Comm = Union[SendActivation, RecvActivation, SendGrad, RecvGrad]
Action = Union[Compute, Comm]
Schedule = Sequence[Sequence[Action]]

COMPUTE_TYPES = (Forward, Backward, OptimizerStep)
COMM_TYPES = (SendActivation, RecvActivation, SendGrad, RecvGrad)
SEND_TYPES = (SendActivation, SendGrad)

# The receive that matches each send, and back.
MATCHING = {
    SendActivation: RecvActivation,
    RecvActivation: SendActivation,
    SendGrad: RecvGrad,
    RecvGrad: SendGrad,
}


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

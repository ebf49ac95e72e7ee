"""Point-to-point transfers between neighbouring pipeline stages.

The schedule's executor contract: communication actions with no compute action
between them form a run; a run is posted together (isend/irecv) and its receives
complete before the next compute action. Messages between two stages match in posting
order, so no tags are needed. Each channel (training, evaluation) uses its own
process group, so an evaluation pass can run while training microbatches are in
flight without their messages mixing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron_async.schedules.actions import RecvActivation, SendActivation, SendGrad


@dataclass
class StageLinks:
    """Global ranks of this stage's neighbours and the group used to reach them."""

    stage: int
    num_stages: int
    prev_rank: Optional[int]
    next_rank: Optional[int]
    group: Optional[dist.ProcessGroup]

    def peer_rank(self, peer_stage: int) -> int:
        if peer_stage == self.stage - 1 and self.prev_rank is not None:
            return self.prev_rank
        if peer_stage == self.stage + 1 and self.next_rank is not None:
            return self.next_rank
        raise ValueError(f"stage {self.stage} has no neighbour stage {peer_stage}")


def stage_links(pp_group: dist.ProcessGroup, group: Optional[dist.ProcessGroup] = None) -> StageLinks:
    """Links over the pipeline group `pp_group` (or `group`, a duplicate of it for another channel)."""
    ranks = dist.get_process_group_ranks(pp_group)
    stage, size = ranks.index(dist.get_rank()), len(ranks)
    return StageLinks(
        stage=stage,
        num_stages=size,
        prev_rank=ranks[stage - 1] if stage > 0 else None,
        next_rank=ranks[stage + 1] if stage < size - 1 else None,
        group=group if group is not None else pp_group,
    )


def duplicate_pipeline_group(pp_group: dist.ProcessGroup, backend: str | None = None) -> dist.ProcessGroup:
    """A second group over each pipeline's ranks (collective: every rank must call it);
    `backend="gloo"`: a host group, for CPU scalars that must not become device work."""
    mine = None
    for ranks in _all_pipeline_groups(pp_group):
        group = dist.new_group(ranks, backend=backend)
        if dist.get_rank() in ranks:
            mine = group
    return mine


def first_last_group(pp_group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A group over each pipeline's first and last rank (collective: every rank must call
    it), for tied embeddings (pipeline/tied_embeddings.py); None on the stages between.
    Its pair's communicator is made by the link's first contact (TiedEmbeddings.connect)."""
    mine = None
    for ranks in _all_pipeline_groups(pp_group):
        pair = [ranks[0], ranks[-1]]
        group = dist.new_group(pair)
        if dist.get_rank() in pair:
            mine = group
    return mine


def _all_pipeline_groups(pp_group: dist.ProcessGroup) -> list[list[int]]:
    """Every pipeline's global ranks, identical on all ranks (gathered once at setup)."""
    mine = dist.get_process_group_ranks(pp_group)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return sorted({tuple(r) for r in gathered})


def post_run(run, links: StageLinks, outgoing: dict, shape, dtype, device) -> tuple[dict, list]:
    """Post one run of comm actions and wait for its receives.

    Sends are not waited for: a stage never blocks on a neighbour taking its data
    (gloo's send otherwise waits for the matching receive), only on data it needs.
    `outgoing` maps (kind, microbatch) to the tensor a send transmits. Returns the
    received tensors by (kind, microbatch) and the posted sends as (microbatch, work, tensor).
    """
    receives, sends, received = [], [], {}
    for action in run:
        peer = links.peer_rank(action.peer)
        if isinstance(action, (SendActivation, SendGrad)):
            kind = "act" if isinstance(action, SendActivation) else "grad"
            tensor = outgoing.pop((kind, action.microbatch)).contiguous()
            sends.append((action.microbatch, dist.isend(tensor, peer, group=links.group), tensor))
        else:
            kind = "act" if isinstance(action, RecvActivation) else "grad"
            buf = torch.empty(shape, dtype=dtype, device=device)
            receives.append(dist.irecv(buf, peer, group=links.group))
            received[(kind, action.microbatch)] = buf
    for work in receives:
        work.wait()
    return received, sends


class PendingSends:
    """Sends this stage has posted and not yet waited on, bounded by the schedule.

    Under gloo a send's work object does not report completion unless someone
    waits on it, so a list pruned by `is_completed()` only grows. Instead each send
    is kept with the batch of its microbatch, and after this stage's optimizer step
    t every send of batch t-1 or earlier is waited on: by then its receive has
    provably completed on the neighbour (stage s cannot finish step t before stage
    s+1 has received every activation of batch t, nor before stage s-1, whose
    warm-up is at most m forwards deep, has received every gradient of batch t-1),
    so the wait returns at once and never deadlocks. The number held is bounded
    whatever the run length: right before its step t a stage still holds its sends
    of batch t-1 and t and of batch t+1's warm-up (about two batches; the memory plan
    counts them exactly by replaying the stream, megatron_async/planning/send_buffers.py).
    """

    def __init__(self, num_microbatches: int):
        self.m = num_microbatches
        self._sends: list = []  # (batch, work, tensor)

    def __len__(self) -> int:
        return len(self._sends)

    def add(self, sends: list) -> None:
        """Hold `sends` as post_run returns them: (microbatch, work, tensor), dropping
        the ones already complete (on NCCL `is_completed()` reports a finished send; under
        gloo it stays False until waited on, so there the bound above does the work)."""
        self._sends = [entry for entry in self._sends if not entry[1].is_completed()]
        self._sends.extend((k // self.m, work, tensor) for k, work, tensor in sends)

    def retire_through(self, batch: int) -> None:
        """Wait on (and drop) every send of `batch` or earlier."""
        keep = []
        for entry in self._sends:
            if entry[0] <= batch:
                entry[1].wait()
            else:
                keep.append(entry)
        self._sends = keep

    def wait_all(self, timeout_s: float | None = None) -> int:
        """Wait on every send held; with `timeout_s`, give each at most that long (a
        neighbour may be gone) and return how many were never received."""
        import datetime

        lost = 0
        for _batch, work, _tensor in self._sends:
            if timeout_s is None:
                work.wait()
                continue
            try:
                work.wait(datetime.timedelta(seconds=timeout_s))
            except RuntimeError:
                lost += 1
        self._sends = []
        return lost

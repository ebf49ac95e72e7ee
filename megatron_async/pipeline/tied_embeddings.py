"""Tied input and output embeddings under 2bw: point to point, first stage to last.

Megatron keeps a tied model's two copies, the first stage's word embeddings E and
the last stage's output weight O, equal by all-reducing their gradients over the
two stages in finalize_model_grads: a blocking collective spanning stages every
step, which 2bw's steady state must not have (megatron_lm/adapter/hooks.py turns it off under 2bw).
Under 2bw every stage computes batch t's gradients at the same version W(t-1), so
E's and O's gradients of batch t sum to the tied gradient of the one-step-delay
twin. The first stage owns the weight:

- at OptimizerStep(t), after Megatron's data-parallel reduction, the last stage
  sends O's gradient (a copy: Megatron zeroes the buffer at the next iteration) and
  the first stage adds it to E's gradient before its optimizer step: Megatron's own
  sum, in Megatron's order (reduced over data-parallel ranks, then over the pair);
- after its step the first stage sends the new weights W(t+1); the last stage
  installs them into its live output weight at the first point that reads them: its
  step t+1, which saves the live weights into the stash (under 2bw's own lists batch
  t+1 runs at W(t), held by the stash), or a forward at version t+1 before that step
  (the combined-step lists' warm-up forward on the last stage). The last stage's own
  update of O is discarded that way. That forward never waits on the last stage itself:
  the first stage ran its own forward of the same microbatch at version t+1, so its step t,
  and the send right after it, came first.

Timing, from the action lists (planning/tied_link_timing.py, tests/test_tied_timing.py):
the last stage reaches OptimizerStep(t) (p-1) backward slots before the first stage,
so the gradient waits for nobody; W(t+1) is needed m(F+B) - (p-1)B later. Each
pipeline's (first, last) pair talks over a group of its own, so the transfers never
queue behind activations, evaluation or the stale-norm all-reduce; the pair's first
contact is a matched exchange when the link is made (`connect`). Per step the first
stage posts [recv grad(t) once batch t's last activation is sent, send W(t+1) after
its step], the last [send grad(t), recv W(t+1) after its step]: matched in order. No posted
receive or send waits on anything its peer does after the point where it was posted
(the last stage's step t needs nothing from the first stage after batch t's last
activation send; the first stage's step t nothing from the last after its step t), so a
whole-device wait anywhere (NCCL's transfers are device work until matched) can
delay but never hang. The last stage's W(t+1) receive stays posted across its step
end: posted later, the first stage's send would wait across its own step end for a
receive the last stage posts only after an all-rank collective that stage may be in.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


class TiedEmbeddings:
    """One end of the tied-embedding link: `first` holds E, else this is the last stage's O."""

    def __init__(self, weight: torch.nn.Parameter, live: torch.Tensor, group, peer: int, first: bool,
                 whole=lambda: None):
        self.weight = weight
        self.live = live  # the weight's live storage (the stash may point `weight.data` elsewhere)
        # waits for the overlapped all-gather of the live weight (--overlap-param-gather): before the
        # first stage sends it, and before the last stage overwrites it (stash/param_gather.py)
        self.whole = whole
        self.group, self.peer, self.first = group, peer, first
        self._grad_recv: Optional[tuple] = None  # first stage: (work, buffer) of grad(t)
        self._weight_send = None  # first stage: the work of W(t+1)'s send (of the live weights)
        self._grad_send: Optional[tuple] = None  # last stage: (work, copy) of grad(t)
        self._weight_recv: Optional[tuple] = None  # last stage: (work, buffer) of W(t+1)

    def connect(self) -> None:
        """At link creation, where both ends are: one matched exchange each way on the
        link's own group. Megatron makes no device-bound process groups, so torch makes
        a pair's NCCL communicator at the pair's first unbatched send or receive and
        blocks the host there until the peer's first; without this the first stage's
        first gradient receive would wait for the last stage's first send at its step,
        which needs forwards the blocked first stage has not sent. First sends then
        receives, last receives then sends: the order of the link's later transfers."""
        out = torch.zeros(1, dtype=self.live.dtype, device=self.live.device)
        into = torch.empty_like(out)
        if self.first:
            works = [dist.isend(out, self.peer, group=self.group), dist.irecv(into, self.peer, group=self.group)]
        else:
            works = [dist.irecv(into, self.peer, group=self.group), dist.isend(out, self.peer, group=self.group)]
        for work in works:
            work.wait()

    # --- the first stage ----------------------------------------------------------
    def post_grad_recv(self) -> None:
        """First stage, once batch t's last activation send is posted: the receive of the
        last stage's grad(t). Posted no earlier: a posted receive is device work until its
        data comes, and a whole-device wait on this stage (an allocator retry, `empty_cache`)
        would then wait for the last stage's step t, which needs every activation of batch t
        from here."""
        if self.first and self._grad_recv is None:
            buffer = torch.empty_like(self.weight.main_grad)
            self._grad_recv = (dist.irecv(buffer, self.peer, group=self.group), buffer)

    @torch.no_grad()
    def exchange_grads(self) -> None:
        """At OptimizerStep(t), after the data-parallel reduction: the last stage sends
        O's gradient, the first adds it to E's."""
        grad = self.weight.main_grad
        if self.first:
            self.post_grad_recv()  # normally posted once the batch's last activation was sent
            work, buffer = self._grad_recv
            self._grad_recv = None
            work.wait()
            grad.add_(buffer)
            return
        self._wait_grad_send()
        copy = grad.detach().clone()
        self._grad_send = (dist.isend(copy, self.peer, group=self.group), copy)

    def before_step(self) -> None:
        """Before the optimizer step (and its stash snapshot): the last stage installs
        W(t) (sent after the first stage's step t-1) unless a forward at version t
        installed it already; the first stage makes sure its
        send of the live weights is done before the step changes them."""
        if self.first:
            if self._weight_send is not None:
                self._weight_send.wait()
                self._weight_send = None
            return
        self.install()

    def after_step(self) -> None:
        """After the optimizer step t: the first stage sends W(t+1), the last posts its receive."""
        if self.first:
            self.whole()
            self._weight_send = dist.isend(self.live, self.peer, group=self.group)
            return
        self._wait_grad_send()
        buffer = torch.empty_like(self.live)
        self._weight_recv = (dist.irecv(buffer, self.peer, group=self.group), buffer)

    @torch.no_grad()
    def install(self) -> None:
        """Last stage: wait for the newest weights sent and write them into the live output weight."""
        if self.first or self._weight_recv is None:
            return
        work, buffer = self._weight_recv
        self._weight_recv = None
        work.wait()
        self.whole()
        self.live.copy_(buffer)

    def _wait_grad_send(self) -> None:
        if self._grad_send is not None:
            self._grad_send[0].wait()
            self._grad_send = None

    def drain(self) -> None:
        """Before a save, an evaluation or an exit: the live weights are the newest on
        both stages and no transfer of this link is left posted."""
        if self.first:
            self.before_step()
        else:
            self.install()
            self._wait_grad_send()

    def abandon(self, timeout_s: float) -> int:
        """Training stopped by an exception: wait (bounded) for this end's sends; returns how
        many were never received. Receives posted are left: nothing is driven any further."""
        import datetime

        sends = [w for w in (self._weight_send, self._grad_send and self._grad_send[0]) if w is not None]
        self._weight_send = self._grad_send = None
        lost = 0
        for work in sends:
            try:
                work.wait(datetime.timedelta(seconds=timeout_s))
            except RuntimeError:
                lost += 1
        return lost


def _language_model(model):
    """The GPT inside DDP and other wrappers (Megatron's own unwrapping)."""
    from megatron.core.utils import get_attr_wrapped_model

    return get_attr_wrapped_model(model, "pre_process", return_model_obj=True)


def ties_across_stages(model, pp_group) -> bool:
    """Whether the last stage holds a copy of the first stage's word embeddings (tied
    output weights, or multi-token prediction's embedding), over a pipeline (`pp_group`) of 2
    or more stages: the same answer on every rank."""
    inner = _language_model(model)
    shares = getattr(inner, "share_embeddings_and_output_weights", False)
    mtp = getattr(getattr(inner, "config", None), "mtp_num_layers", None)
    return bool(shares or mtp) and dist.get_world_size(pp_group) > 1


def tied_weight(model, pp_group) -> Optional[torch.nn.Parameter]:
    """The word embeddings (first stage) or the last stage's copy of them: its output weight
    when tied, multi-token prediction's embedding with MTP (one parameter if both)."""
    inner = _language_model(model)
    if getattr(inner, "mtp_process", False) and not inner.post_process:
        raise ValueError("megatron-async: under 2bw the multi-token prediction layers must be on the last "
                         "pipeline stage (its copy of the word embeddings is exchanged with the first stage)")
    if not ties_across_stages(model, pp_group) or inner.pre_process == inner.post_process:
        return None  # a stage between, or (PP=1) both ends on one stage: nothing to exchange
    return inner.shared_embedding_or_output_weight()


def link_for(model, stash, group, pp_group) -> Optional[TiedEmbeddings]:
    """This stage's end of the link (first or last stage of a tied model, over the pipeline
    `pp_group`), else None."""
    weight = tied_weight(model, pp_group)
    if weight is None:
        return None
    ranks = dist.get_process_group_ranks(pp_group)
    first = ranks.index(dist.get_rank()) == 0
    link = TiedEmbeddings(weight, stash.live_storage(weight), group, ranks[-1] if first else ranks[0], first,
                          whole=lambda: stash.gather_update([weight]))
    link.connect()
    return link

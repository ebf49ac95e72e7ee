"""What the 2bw runtime posts keeps NCCL's one-queue-per-link order and Transformer
Engine's gradient-accumulation order (schedules/link_order.py): the streamed lists
of every depth 2..8 over a range of microbatch counts, run to the end or stopped
early (with the executor's drain), with drains between steps, fresh or resumed at a
later batch; the other one-piece-per-stage schedules too. Swapped operations fail
each check."""

from collections import deque
from functools import lru_cache
from types import SimpleNamespace

import pytest

from megatron_async.schedules.actions import (
    Backward,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    SendActivation,
    is_comm,
    is_send,
)
from megatron_async.schedules.gen_2bw import min_microbatches_2bw, version_2bw
from megatron_async.schedules.generators import generate
from megatron_async.schedules.link_order import (
    StepEnd,
    TiedTransfer,
    check_posted_receives,
    with_tied_link,
    check_blocking_rendezvous,
    check_step_ends,
    check_grad_accumulation_order,
    check_link_order,
)
from megatron_async.schedules.stream_2bw import TEMPLATE_BATCHES, TwoBWStream
from megatron_async.schedules.validator import ScheduleError, check_deadlock_free

# the run's process groups as the executor reads them: no context parallelism
ONE_RANK_GROUPS = SimpleNamespace(cp=SimpleNamespace(size=lambda: 1))

BATCHES = TEMPLATE_BATCHES + 1  # relabelled steady and last segments, not only the template's
FIRSTS = (0, 5)  # a fresh run and one resumed at batch 5
STOPS = (None, 0, 1, BATCHES - 2)  # run to the end, or stop after this batch (index within the run)
EVERY = frozenset(range(BATCHES))  # a drain (save, evaluation) after every batch


def microbatch_counts(p: int) -> list[int]:
    low = min_microbatches_2bw(p)
    return sorted({low, low + 1, p, 2 * p + 1, 64})  # 64: p=4, m=64 is the 10B MoE configuration


SHAPES = [(p, m) for p in range(2, 9) for m in microbatch_counts(p)]


@lru_cache(maxsize=None)
def stream(p: int, m: int, first: int) -> TwoBWStream:
    return TwoBWStream(p, m, BATCHES, first)


@lru_cache(maxsize=None)
def segment(s: TwoBWStream, stage: int, b: int) -> tuple:
    """The stream's segment, relabelled once (relabelling dominates this file's time)."""
    return tuple(s.segment(stage, b))


def runtime_lists(s: TwoBWStream, stop=None, drains=(), ahead=True) -> list[list]:
    """Each stage's actions as the runtime posts them, for a run stopped after batch
    `stop` (None: run to the end, where finish runs the trailing sends) with a drain
    (a save, an evaluation) after each batch in `drains`, and StepEnd(t) where
    train_step(t) returns to Megatron. Every train_step receives the previous stage's
    activations of later batches from its segment that this stage lacks; the list's
    own receives of those are then not posted again (StageExecutor._receive_sent_ahead).
    `ahead=False`: the runtime before that receive (a drain or finish's drain did it
    only when called), the negative control of the step-end checks."""
    last = s.n - 1 if stop is None else stop
    out = []
    for stage in range(s.p):
        posted, drained = [], set()
        pieces = [segment(s, stage, b) for b in range(last + 1)] + ([s.tail(stage)] if stop is None else [])
        for b, piece in enumerate(pieces):
            for a in piece:
                if isinstance(a, RecvActivation) and a.microbatch in drained:
                    drained.discard(a.microbatch)
                else:
                    posted.append(a)
            if b > last:
                continue
            missing = []
            if stage and (ahead or b in drains or (b == last and stop is not None)):
                later = (s.first + b + 1) * s.m
                have = {a.microbatch for a in posted if isinstance(a, RecvActivation)}
                missing = [RecvActivation(a.microbatch, stage - 1) for a in segment(s, stage - 1, b)
                           if isinstance(a, SendActivation) and a.microbatch >= later and a.microbatch not in have]
                drained |= {a.microbatch for a in missing}
            # before StepEnd: train_step's early receive; after it: a drain (or finish's) Megatron calls
            posted += (missing + [StepEnd(s.first + b)]) if ahead else ([StepEnd(s.first + b)] + missing)
        out.append(posted)
    return out


@pytest.mark.parametrize("p, m", SHAPES)
def test_2bw_runtime_posts_keep_link_order_and_finish(p, m):
    for first in FIRSTS:
        s = stream(p, m, first)
        for stop in STOPS:
            lists = runtime_lists(s, stop)
            if stop is not None:  # the last step's early receive stands in for finish's drain
                assert all(isinstance(acts[-2], RecvActivation) for acts in lists[1:]), (first, stop)
            check_link_order(lists)
            check_blocking_rendezvous(lists)
            check_step_ends(lists)
            check_blocking_rendezvous(lists, step_end_barrier=True)
            # a drain between steps receives nothing more: nothing changes order
            assert runtime_lists(s, stop, EVERY) == lists, (first, stop)


@pytest.mark.parametrize("p, m", [(2, 1), (4, 4), (8, 8)])
def test_sends_left_for_the_next_step_fail_the_step_end_checks(p, m):
    """Negative control: the runtime without the step-end receive (receiving a later
    batch's activation only after its own step end) fails both step-end checks, and
    only them: link order and the rendezvous without barriers hold."""
    lists = runtime_lists(stream(p, m, 0), ahead=False)
    check_link_order(lists)
    check_blocking_rendezvous(lists)
    with pytest.raises(ScheduleError, match="only after its own StepEnd"):
        check_step_ends(lists)
    with pytest.raises(ScheduleError, match="an all-rank barrier at the step end"):
        check_blocking_rendezvous(lists, step_end_barrier=True)


@pytest.mark.parametrize("p, m", SHAPES)
def test_2bw_first_backward_of_each_batch_is_its_first_microbatch(p, m):
    for first in FIRSTS:
        for stop in (None, 1):
            check_grad_accumulation_order(runtime_lists(stream(p, m, first), stop), m)


@pytest.mark.parametrize("p, m, first", [(2, 1, 0), (3, 5, 5), (4, 4, 0)])
def test_runtime_lists_are_what_the_executor_posts(p, m, first, monkeypatch):
    """The real StageExecutor (train_step, drain, finish) with compute and transfers
    replaced by recorders posts exactly `runtime_lists`; the lists of the runtime
    without the step-end receive differ from what it posts (negative control)."""
    s = stream(p, m, first)
    for stop, drains in [(stop, ()) for stop in STOPS] + [(None, EVERY), (BATCHES - 2, EVERY)]:
        expected = runtime_lists(s, stop, drains)
        for stage in range(p):
            posted = executor_posts(s, stage, stop, drains, monkeypatch)
            assert posted == expected[stage], (stage, stop, drains)
            if stage:  # the early receive is there, before the step end
                assert posted != runtime_lists(s, stop, drains, ahead=False)[stage], (stage, stop, drains)


def executor_posts(s: TwoBWStream, stage: int, stop, drains, monkeypatch) -> list:
    """Every action stage `stage`'s executor runs or posts, in order, built as the 2bw
    runner builds it, over the run `runtime_lists` describes."""
    from megatron_async.pipeline import executor as ex
    from megatron_async.pipeline.p2p import StageLinks
    from megatron_async.pipeline.stage_context import StageContext

    posted = []

    def post_run(run, links, outgoing, shape, dtype, device):
        posted.extend(run)
        kinds = {RecvActivation: "act", RecvGrad: "grad"}
        return {(kinds[type(a)], a.microbatch): object() for a in run if not is_send(a)}, []

    monkeypatch.setattr(ex, "post_run", post_run)
    monkeypatch.setattr(ex, "get_model_config", lambda model: None)
    class Steps(ex.StageEvents):
        def optimizer_step(self, step):
            posted.append(OptimizerStep(step))

    context = StageContext(None, StageLinks(stage, s.p, None, None, None), None, None, s.m, None, None, None,
                           ONE_RANK_GROUPS)
    e = ex.StageExecutor(context, s.actions(stage), Steps(), s)

    def forward(a, _data_for):  # what the real forward consumes and keeps
        posted.append(a)
        if stage:
            e._received.pop(("act", a.microbatch))
        e._inflight[a.microbatch] = None

    def backward(a):
        posted.append(a)
        e._inflight.pop(a.microbatch)
        if stage < s.p - 1:
            e._received.pop(("grad", a.microbatch))

    e._forward, e._backward = forward, backward
    for b in range((s.n - 1 if stop is None else stop) + 1):
        e.train_step(s.first + b, None)
        posted.append(StepEnd(s.first + b))
        if b in drains and (stop is None or b < stop):
            e.drain()
    e.finish()
    return posted


ONE_PIECE = ["1f1b", "gpipe", "pipedream", "zb-h1"]


@pytest.mark.parametrize("name", ONE_PIECE)
def test_one_piece_schedules_keep_link_order(name):
    for p in range(2, 9):
        for m in (1, p, 2 * p + 1):
            lists = generate(name, p, m, 2)
            check_link_order(lists)
            check_blocking_rendezvous(lists)
            # pipedream steps after every microbatch: a batch of one, as the executor would flag it
            check_grad_accumulation_order(lists, 1 if name == "pipedream" else m)


@pytest.mark.parametrize("name", ["interleaved-1f1b", "zbv"])
def test_several_piece_schedules_need_grouped_posting(name):
    """Interleaved 1F1B and ZB-V have two stages send to each other at once, so their
    lists are built for buffered sends (Megatron runs interleaved with batched p2p,
    which NCCL posts as one group; ZB-V is lists only): per-operation posting would
    cross on a link, as the check reports. Their accumulation order still holds."""
    for p in (2, 4):
        lists = generate(name, p, 2 * p, 2)
        assert lists.buffered_sends
        with pytest.raises(ScheduleError, match="link"):
            check_link_order(lists)
        check_grad_accumulation_order(lists, 2 * p)


def swap(acts: list, i: int, j: int) -> list:
    out = list(acts)
    out[i], out[j] = out[j], out[i]
    return out


def test_two_comm_ops_swapped_on_one_end_fail_both_checks():
    """Negative control: stage 1 posts a send and a receive on its link to stage 2 the
    other way round. The per-direction batched replay accepts it; both checks do not."""
    lists = runtime_lists(stream(4, 4, 0))
    acts = lists[1]
    i = next(i for i in range(len(acts) // 2, len(acts) - 1)
             if is_comm(acts[i]) and is_comm(acts[i + 1]) and acts[i].peer == acts[i + 1].peer == 2
             and is_send(acts[i]) != is_send(acts[i + 1]))
    bad = [*lists[:1], swap(acts, i, i + 1), *lists[2:]]
    check_deadlock_free(bad, "batched")  # what the per-direction validator sees: fine
    with pytest.raises(ScheduleError) as err:
        check_link_order(bad)
    # the first place the ends differ: the swapped-in operation against the other end's
    for fragment in ("link 1-2, operation", f"stage 1 posts {acts[i + 1]!r} (action {i})", "stage 2 posts"):
        assert fragment in str(err.value), str(err.value)
    with pytest.raises(ScheduleError) as err:
        check_blocking_rendezvous(bad)
    assert "deadlock" in str(err.value)
    for stage in range(4):  # the jam is mid-run: every stage ends up waiting, each one named
        assert f"stage {stage} blocks at action" in str(err.value), str(err.value)
    check_link_order(lists)  # the unswapped lists pass
    check_blocking_rendezvous(lists)


def test_activations_sent_in_another_order_fail_link_order():
    """Negative control: the two ends agree on kinds but not on microbatches."""
    lists = runtime_lists(stream(3, 4, 0))
    acts = lists[0]
    i, j = [n for n, a in enumerate(acts) if isinstance(a, SendActivation)][4:6]
    with pytest.raises(ScheduleError, match="link 0-1, operation"):
        check_link_order([swap(acts, i, j), *lists[1:]])


def test_an_early_stop_without_the_drain_fails_both_checks():
    """Negative control: stopped after a batch with no drain, stage 1's warm-up sends
    to stage 2 have no receive: unmatched on the link, blocked forever."""
    lists = runtime_lists(stream(4, 5, 0), stop=1, ahead=False)
    undrained = [acts[:acts.index(StepEnd(1)) + 1] for acts in lists]  # no step-end receive, no finish
    with pytest.raises(ScheduleError, match="has no operation left on this link"):
        check_link_order(undrained)
    with pytest.raises(ScheduleError, match="stage 3 has finished its list"):
        check_blocking_rendezvous(undrained)


def _move(acts: list, action, steps: int) -> list:
    """`acts` with `action` moved `steps` places later (earlier if negative)."""
    out = list(acts)
    i = out.index(action)
    out.insert(i + steps, out.pop(i))
    return out


def test_two_backwards_of_a_batch_swapped_fail_the_accumulation_check():
    p, m = 4, 4
    lists = runtime_lists(stream(p, m, 0))
    acts = lists[2]
    bad = swap(acts, acts.index(Backward(m, version_2bw(m, m))), acts.index(Backward(m + 1, version_2bw(m + 1, m))))
    with pytest.raises(ScheduleError, match=f"first backward of batch 1 is microbatch {m + 1}, not {m}"):
        check_grad_accumulation_order([*lists[:2], bad, *lists[3:]], m)
    check_grad_accumulation_order(lists, m)


def test_a_step_on_the_wrong_side_of_a_backward_fails_the_accumulation_check():
    p, m = 4, 4
    lists = runtime_lists(stream(p, m, 0))
    acts = lists[1]
    step = OptimizerStep(1)
    i = acts.index(step)
    last_backward = max(n for n in range(i) if isinstance(acts[n], Backward))
    early = _move(acts, step, last_backward - i)  # OptimizerStep(1) before batch 1's last backward
    with pytest.raises(ScheduleError, match="after OptimizerStep\\(1\\)"):
        check_grad_accumulation_order([lists[0], early, *lists[2:]], m)
    first_of_next = next(n for n, a in enumerate(acts) if isinstance(a, Backward) and a.microbatch == 2 * m)
    late = _move(acts, step, first_of_next - i)  # OptimizerStep(1) after batch 2's first backward
    with pytest.raises(ScheduleError, match="before OptimizerStep\\(1\\)"):
        check_grad_accumulation_order([lists[0], late, *lists[2:]], m)


TIED_SHAPES = [(p, m) for p in (2, 3, 4, 8) for m in sorted({min_microbatches_2bw(p), p + 1, 2 * p + 1})]


@pytest.mark.parametrize("p, m", TIED_SHAPES)
def test_no_receive_of_the_tied_link_waits_for_later_work(p, m):
    """The tied link's transfers (pipeline/tied_embeddings.py) where the runtime posts
    them, fresh and resumed, run to the end or stopped: in order on their own group, and
    a replay that waits on every receive where it is posted (a host in NCCL's lazy pair
    creation, or a whole-device wait with the receive posted) finishes, with all-rank
    barriers at the step ends too. The pipeline's own lists pass the same replay."""
    for first in FIRSTS:
        for stop in (None, 1):
            plain = runtime_lists(stream(p, m, first), stop)
            check_posted_receives(plain, step_end_barrier=True)
            lists = with_tied_link(plain, m)
            assert sum(isinstance(a, TiedTransfer) for a in lists[0]) > 2
            check_link_order(lists)
            check_step_ends(lists)
            check_posted_receives(lists)
            check_posted_receives(lists, step_end_barrier=True)


@pytest.mark.parametrize("p, m", [(2, 3), (2, 4), (4, 5), (8, 17)])
def test_negative_control_the_gradient_receive_at_the_first_backward_deadlocks(p, m):
    """m > p: posted at batch t's first backward, the receive waits for the last stage's
    step t, which needs activations the first stage sends later. Without the first contact
    (the link as it was) the replay stops at that same receive."""
    for contact in (True, False):
        lists = with_tied_link(runtime_lists(stream(p, m, 0)), m, grad_recv="first backward", contact=contact)
        check_link_order(lists)
        with pytest.raises(ScheduleError, match=r"stage 0 blocks at action \d+ \(TiedRecv\(grad 0, peer"):
            check_posted_receives(lists)


PAIRED_SHAPES = [(p, m) for p in range(2, 7) for m in sorted({2 * p - 1, 2 * p + 1})]


@pytest.mark.parametrize("p, m", PAIRED_SHAPES)
def test_2bw_combined_step_lists_keep_link_order_and_accumulation_order(p, m):
    """2bw's lists for --overlap-moe-expert-parallel-comm (gen_2bw_paired) as the runtime posts
    them: a combined step's backward accumulates like a Backward, batch b's first on microbatch
    b*m. Control: two combined steps' backwards swapped fail the accumulation check."""
    from megatron_async.schedules.actions import ForwardBackward

    for first in FIRSTS:
        s = TwoBWStream(p, m, BATCHES, first, paired=True)
        for stop in (None, 1):
            lists = runtime_lists(s, stop)
            check_link_order(lists)
            check_step_ends(lists)
            check_blocking_rendezvous(lists, step_end_barrier=True)
            check_grad_accumulation_order(lists, m)
    acts = list(runtime_lists(TwoBWStream(p, m, BATCHES, 0, paired=True))[0])
    pairs = [i for i, a in enumerate(acts) if isinstance(a, ForwardBackward)]
    i, j = pairs[0], pairs[1]
    acts[i], acts[j] = (ForwardBackward(acts[i].forward, acts[j].backward),
                        ForwardBackward(acts[j].forward, acts[i].backward))
    with pytest.raises(ScheduleError, match="the first backward of batch 0"):
        check_grad_accumulation_order([acts], m)

"""The stage executor runs only the actions it knows and stops, naming the action, at any
other: a zero-bubble list's split backward (BackwardInput/BackwardWeight), which the
validator and the simulator accept, must not be skipped in silence. Control: the same
executor runs a 1F1B list of the same shape to its end."""

from types import SimpleNamespace

import pytest

from megatron_async.schedules.actions import OptimizerStep, RecvActivation, RecvGrad, ScheduleError, is_comm
from megatron_async.schedules.generators import generate

# the run's process groups as the executor reads them: no context parallelism
ONE_RANK_GROUPS = SimpleNamespace(cp=SimpleNamespace(size=lambda: 1))


def _executor(actions, stage: int, p: int, m: int, monkeypatch, ran: list):
    from megatron_async.pipeline import executor as ex
    from megatron_async.pipeline.p2p import StageLinks
    from megatron_async.pipeline.stage_context import StageContext

    def post_run(run, links, outgoing, shape, dtype, device):
        kinds = {RecvActivation: "act", RecvGrad: "grad"}
        return {(kinds[type(a)], a.microbatch): object() for a in run if type(a) in kinds}, []

    monkeypatch.setattr(ex, "post_run", post_run)
    monkeypatch.setattr(ex, "get_model_config", lambda model: None)
    class Steps(ex.StageEvents):
        def optimizer_step(self, step):
            ran.append(OptimizerStep(step))

    context = StageContext(None, StageLinks(stage, p, None, None, None), None, None, m, None, None, None,
                           ONE_RANK_GROUPS)
    e = ex.StageExecutor(context, actions, Steps())
    e._forward = lambda action, _data_for: ran.append(action)  # compute replaced by a recorder
    e._backward = ran.append
    return e


@pytest.mark.parametrize("name", ["zb-h1", "1f1b"])
def test_an_action_the_executor_cannot_run_stops_it_by_name(name, monkeypatch):
    p, m = 2, 4
    lists = generate(name, p, m, 1)
    ran: list = []
    e = _executor(lists[0], 0, p, m, monkeypatch, ran)
    if name == "1f1b":  # control: every compute action runs
        e.train_step(0, None)
        assert len(ran) == sum(1 for a in lists[0] if not is_comm(a))
        return
    with pytest.raises(ScheduleError, match=r"stage 0: the executor cannot run BackwardInput\(") as err:
        e.train_step(0, None)
    assert "BackwardInput" in str(err.value) and "Forward" in str(err.value)


@pytest.mark.parametrize("name", ["interleaved-1f1b", "1f1b"])
def test_an_action_on_a_chunk_the_stage_does_not_hold_stops_it(name, monkeypatch):
    """An interleaved list's Forward(chunk=1) must not run chunk 0 in silence."""
    p, m = 2, 4
    lists = generate(name, p, m, 1)
    ran: list = []
    e = _executor(lists[0], 0, p, m, monkeypatch, ran)
    if name == "1f1b":  # control: a one-chunk list runs to its end
        e.train_step(0, None)
        assert ran and all(getattr(a, "chunk", 0) == 0 for a in ran)
        return
    with pytest.raises(ScheduleError, match=r"runs model chunk 1, but this stage holds one chunk"):
        e.train_step(0, None)
    assert all(getattr(a, "chunk", 0) == 0 for a in ran)


@pytest.mark.parametrize("fails", [True, False])
def test_an_evaluation_leaves_the_model_in_train_mode_however_it_ends(fails, monkeypatch):
    """Evaluation is a forward-only list run by an executor (forward_only=True); train mode
    comes back when it raises too. Control: a pass that ends normally returns its reports."""
    import torch

    from megatron_async.pipeline import two_bw
    from megatron_async.pipeline.p2p import StageLinks
    from megatron_async.pipeline.stage_context import StageContext
    from megatron_async.schedules.actions import Forward

    seen = {}

    class FakeExecutor:
        def __init__(self, context, actions):
            self.model = context.model
            seen.update(actions=list(actions), forward_only=True)

        def run(self, data_for):
            seen["training"] = self.model.training
            if fails:
                raise RuntimeError("a forward failed")
            return ["report"]

    monkeypatch.setattr(two_bw, "ForwardOnlyExecutor", FakeExecutor)
    runner = object.__new__(two_bw.TwoBWRunner)
    runner.model = torch.nn.Linear(2, 2)
    runner.stash = type("Stash", (), {"newest": 3})()
    runner.eval_links = StageLinks(0, 1, None, None, None)
    runner.context = StageContext(runner.model, None, runner.stash, None, 2, None, None, None, ONE_RANK_GROUPS)
    runner.drain = lambda: None
    if fails:
        with pytest.raises(RuntimeError, match="a forward failed"):
            runner.evaluate_iterators([iter([1]), iter([2])])
    else:
        assert runner.evaluate_iterators([iter([1]), iter([2])]) == ["report"]
    assert runner.model.training and not seen["training"] and seen["forward_only"]
    assert seen["actions"] == [Forward(0, 3), Forward(1, 3)]


def test_a_combined_step_without_the_flag_stops_naming_it(monkeypatch):
    """2bw's lists with combined steps (gen_2bw_paired) run only through Megatron's combined
    step (--overlap-moe-expert-parallel-comm); an executor without it stops at the first one
    instead of running it some other way. Control: its warm-up forwards before it ran."""
    from megatron_async.schedules.actions import Forward, ForwardBackward
    from megatron_async.schedules.gen_2bw_paired import two_bw_paired

    p, m = 2, 3
    lists = two_bw_paired(p, m, 2)  # (one batch of m = 2p-1 has no combined step: all warm-up)
    ran: list = []
    e = _executor(lists[0], 0, p, m, monkeypatch, ran)
    with pytest.raises(ScheduleError, match=r"ForwardBackward\(.*--overlap-moe-expert-parallel-comm"):
        e.train_step(0, None)
    first = next(i for i, a in enumerate(lists[0]) if isinstance(a, ForwardBackward))
    assert ran == [a for a in lists[0][:first] if isinstance(a, Forward)]


@pytest.mark.parametrize("name", ["forward-only", "1f1b"])
def test_a_forward_only_pass_stops_at_a_backward_or_a_step(name, monkeypatch):
    """An evaluation's executor runs its forwards and refuses what would train. Control: its
    own forward-only list runs to its end, each forward unhooked and kept for no backward."""
    import contextlib

    import torch

    from megatron_async.pipeline import executor as ex
    from megatron_async.pipeline.p2p import StageLinks
    from megatron_async.pipeline.stage_context import StageContext
    from megatron_async.schedules.gen_forward_only import forward_only

    p, m = 2, 4
    lists = forward_only(p, m, 0) if name == "forward-only" else generate("1f1b", p, m, 1)
    monkeypatch.setattr(ex, "post_run", lambda run, *_: ({("act", a.microbatch): torch.zeros(1) for a in run
                                                           if isinstance(a, RecvActivation)}, []))
    monkeypatch.setattr(ex, "get_model_config", lambda model: None)
    monkeypatch.setattr(ex.schedules, "forward_step", lambda *a, **k: (torch.zeros(1), None))
    hooked = []
    stash = SimpleNamespace(use=lambda version, hooks: hooked.append(hooks) or contextlib.nullcontext())
    context = StageContext(None, StageLinks(1, p, None, None, None), stash, None, m, None, None, None,
                           ONE_RANK_GROUPS)
    e = ex.ForwardOnlyExecutor(context, lists[1])
    monkeypatch.setattr(e, "drain", lambda: None)
    if name == "1f1b":
        with pytest.raises(ScheduleError, match=r"stage 1: Backward\(.* in a forward-only pass"):
            e.run(lambda k: None)
        return
    assert e.run(lambda k: None) == []
    assert hooked == [False] * m and e.forwards == m and e._inflight == {}

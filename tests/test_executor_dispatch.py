"""The stage executor runs only the actions it knows and stops, naming the action, at any
other: a zero-bubble list's split backward (BackwardInput/BackwardWeight), which the
validator and the simulator accept, must not be skipped in silence. Control: the same
executor runs a 1F1B list of the same shape to its end."""

import pytest

from megatron_async.schedules.actions import OptimizerStep, RecvActivation, RecvGrad, ScheduleError, is_comm
from megatron_async.schedules.generators import generate


def _executor(actions, stage: int, p: int, m: int, monkeypatch, ran: list):
    from megatron_async.pipeline import executor as ex
    from megatron_async.pipeline.p2p import StageLinks

    def post_run(run, links, outgoing, shape, dtype, device):
        kinds = {RecvActivation: "act", RecvGrad: "grad"}
        return {(kinds[type(a)], a.microbatch): object() for a in run if type(a) in kinds}, []

    monkeypatch.setattr(ex, "post_run", post_run)
    monkeypatch.setattr(ex, "get_model_config", lambda model: None)
    monkeypatch.setattr(ex.parallel_state, "get_context_parallel_world_size", lambda: 1)
    e = ex.StageExecutor(None, actions, StageLinks(stage, p, None, None, None), None, None, None,
                         step_func=lambda t: ran.append(OptimizerStep(t)), num_microbatches=m,
                         activation_shape=None, dtype=None, device=None, final_step=0, first_step=0)
    e._forward = e._backward = ran.append  # compute replaced by a recorder
    return e


@pytest.mark.parametrize("name", ["zb-h1", "1f1b"])
def test_an_action_the_executor_cannot_run_stops_it_by_name(name, monkeypatch):
    p, m = 2, 4
    lists = generate(name, p, m, 1)
    ran: list = []
    e = _executor(lists[0], 0, p, m, monkeypatch, ran)
    if name == "1f1b":  # control: every compute action runs
        e.train_step(0)
        assert len(ran) == sum(1 for a in lists[0] if not is_comm(a))
        return
    with pytest.raises(ScheduleError, match=r"stage 0: the executor cannot run BackwardInput\(") as err:
        e.train_step(0)
    assert "BackwardInput" in str(err.value) and "Forward" in str(err.value)


@pytest.mark.parametrize("name", ["interleaved-1f1b", "1f1b"])
def test_an_action_on_a_chunk_the_stage_does_not_hold_stops_it(name, monkeypatch):
    """An interleaved list's Forward(chunk=1) must not run chunk 0 in silence."""
    p, m = 2, 4
    lists = generate(name, p, m, 1)
    ran: list = []
    e = _executor(lists[0], 0, p, m, monkeypatch, ran)
    if name == "1f1b":  # control: a one-chunk list runs to its end
        e.train_step(0)
        assert ran and all(getattr(a, "chunk", 0) == 0 for a in ran)
        return
    with pytest.raises(ScheduleError, match=r"runs model chunk 1, but this stage holds one chunk"):
        e.train_step(0)
    assert all(getattr(a, "chunk", 0) == 0 for a in ran)


@pytest.mark.parametrize("fails", [True, False])
def test_an_evaluation_leaves_the_model_in_train_mode_however_it_ends(fails, monkeypatch):
    """Evaluation is a forward-only list run by an executor (forward_only=True); train mode
    comes back when it raises too. Control: a pass that ends normally returns its reports."""
    import torch

    from megatron_async.pipeline import two_bw
    from megatron_async.pipeline.p2p import StageLinks
    from megatron_async.schedules.actions import Forward

    seen = {}

    class FakeExecutor:
        def __init__(self, model, actions, links, stash, *args, forward_only=False, **kwargs):
            self.model = model
            seen.update(actions=list(actions), forward_only=forward_only)

        def run_forward_only(self):
            seen["training"] = self.model.training
            if fails:
                raise RuntimeError("a forward failed")
            return ["report"]

    monkeypatch.setattr(two_bw, "StageExecutor", FakeExecutor)
    runner = object.__new__(two_bw.TwoBWRunner)
    runner.model = torch.nn.Linear(2, 2)
    runner.stash = type("Stash", (), {"newest": 3})()
    runner.eval_links = StageLinks(0, 1, None, None, None)
    runner.shape, runner.dtype, runner.device, runner.forward_step_func = None, None, None, None
    runner.drain = lambda: None
    if fails:
        with pytest.raises(RuntimeError, match="a forward failed"):
            runner.evaluate_iterators([iter([1]), iter([2])])
    else:
        assert runner.evaluate_iterators([iter([1]), iter([2])]) == ["report"]
    assert runner.model.training and not seen["training"] and seen["forward_only"]
    assert seen["actions"] == [Forward(0, 3), Forward(1, 3)]

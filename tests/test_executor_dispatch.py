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

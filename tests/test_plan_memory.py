"""The memory plan's count of 2bw's point-to-point buffers (megatron_async/planning/send_buffers.py).

- On real gloo pipelines (p=2 and p=4, TinyGPT) the replay's peaks per stage (activation
  sends held, gradient sends held, both at once, and all p2p buffers) equal what the
  executor itself holds, recorded before every action it runs; the peak the plan
  prints (its default replay length) is the same; a replay with another retirement
  rule gives other counts (negative control).
- Unit: the replay goes through PendingSends' own rule (a PendingSends that never
  retires makes the held sends grow to every send of the run); the retirement lag
  moves the counts; the default replay length has reached the steady state (a much
  longer run peaks the same, while a rule that never retires does not).
- Retiring a send as soon as it is known complete (NCCL's `is_completed()`, pruned by
  PendingSends.add at the next post), timed by the schedule simulator: the held sends
  do not grow with m (equal at m = 4 and m = 64) and stay below the bound; a send
  that never reports completion gives back the bound (negative control).
- The tensor size agrees with Megatron's own pipeline shape (get_tensor_shapes) for
  sequence and context parallelism and for two dtypes.
"""

from types import SimpleNamespace

import pytest
import torch

from megatron_async.pipeline.p2p import PendingSends
from megatron_async.planning import send_buffers as plan_p2p
from megatron_async.planning.send_buffers import (REPLAY_BATCHES, activation_tensor_bytes, replay, stage_peaks,
                                     stage_peaks_on_completion)
from megatron_async.schedules.actions import SendActivation, SendGrad
from megatron_async.schedules.stream_2bw import TwoBWStream
from tests.support.multiprocess import run_distributed
from tests.support.tiny_gpt import TinyGPT

STEPS = 7  # past the stream's template, so relabelled steady segments run too


def held_buffers_entry(rank, world_size, spec, iterations):
    """Train with 2bw, recording before every action the executor runs the sends it
    holds (by direction), its unposted outputs and its unconsumed receives."""
    from megatron_async.pipeline import executor as executor_module
    from tests.support.tiny_gpt import train

    kinds, peak = {}, {"act_sends": 0, "grad_sends": 0, "sends": 0, "buffers": 0}
    post_run = executor_module.post_run

    def tagging_post_run(run, *args):
        received, sends = post_run(run, *args)
        send_actions = [a for a in run if isinstance(a, (SendActivation, SendGrad))]
        for action, (_k, _work, tensor) in zip(send_actions, sends, strict=True):
            kinds[id(tensor)] = "act" if isinstance(action, SendActivation) else "grad"
        return received, sends

    peek = executor_module.StageExecutor._peek

    def recording_peek(self):
        held = [kinds[id(tensor)] for _batch, _work, tensor in self.pending_sends._sends]
        peak["act_sends"] = max(peak["act_sends"], held.count("act"))
        peak["grad_sends"] = max(peak["grad_sends"], held.count("grad"))
        peak["sends"] = max(peak["sends"], len(self.pending_sends))
        peak["buffers"] = max(peak["buffers"], len(self.pending_sends) + len(self._outgoing) + len(self._received))
        return peek(self)

    executor_module.post_run = tagging_post_run  # this rank's own process: nothing else sees it
    executor_module.StageExecutor._peek = recording_peek
    result = train(spec, iterations, rank, world_size)
    return {"pp_rank": result["pp_rank"], "peak": peak}


@pytest.mark.parametrize("pp,microbatches", [(2, 4), (4, 6)])
def test_replay_equals_what_the_executor_holds(pp, microbatches):
    spec = TinyGPT(pp=pp, schedule="2bw", num_layers=4, micro_batch_size=2, global_batch_size=2 * microbatches,
                   clip_grad=0.0)
    results = run_distributed(held_buffers_entry, pp, spec, STEPS)
    real = {r["pp_rank"]: r["peak"] for r in results}
    assert real[0]["sends"] > 0 and real[pp - 1]["grad_sends"] > 0  # the recording saw sends
    for name, peaks in (("same run", stage_peaks(pp, microbatches, batches=STEPS)),
                        ("plan", stage_peaks(pp, microbatches))):
        assert {s: vars(c) for s, c in enumerate(peaks)} == real, name
    for lag in (0, 2):  # another retirement rule: other counts
        other = {s: vars(c) for s, c in enumerate(stage_peaks(pp, microbatches, batches=STEPS, retire_lag=lag))}
        assert other != real


def _sends(actions) -> int:
    return sum(isinstance(a, (SendActivation, SendGrad)) for a in actions)


def test_replay_retires_through_pending_sends(monkeypatch):
    p, m, n = 4, 5, 6
    lists = TwoBWStream(p, m, n).lists()
    kept = [replay(actions, m, s == 0, s == p - 1) for s, actions in enumerate(lists)]
    monkeypatch.setattr(PendingSends, "retire_through", lambda self, batch: None)
    never = [replay(actions, m, s == 0, s == p - 1) for s, actions in enumerate(lists)]
    for s, actions in enumerate(lists):
        assert never[s].sends == _sends(actions)  # nothing retired: every send of the run held
        assert kept[s].sends < never[s].sends


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 9), (6, 5)])
def test_retirement_lag_moves_the_counts(p, m):
    peaks = {lag: stage_peaks(p, m, retire_lag=lag) for lag in (0, 1, 2)}
    for s in range(p):
        assert peaks[0][s].sends < peaks[1][s].sends < peaks[2][s].sends
        assert peaks[1][s].sends <= peaks[1][s].buffers


@pytest.mark.parametrize("p,m", [(2, 3), (4, 4), (4, 7), (8, 8)])
def test_default_replay_reaches_the_steady_state(p, m, monkeypatch):
    assert stage_peaks(p, m) == stage_peaks(p, m, batches=4 * REPLAY_BATCHES)
    monkeypatch.setattr(PendingSends, "retire_through", lambda self, batch: None)  # the check can fail
    assert stage_peaks(p, m) != stage_peaks(p, m, batches=4 * REPLAY_BATCHES)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_sends_retired_on_completion_do_not_grow_with_the_batch(p, monkeypatch):
    small, large = stage_peaks_on_completion(p, max(4, p)), stage_peaks_on_completion(p, 64)
    bound = stage_peaks(p, 64)
    assert [x.sends for x in small] == [x.sends for x in large]
    assert all(0 < x.sends < b.sends for x, b in zip(large, bound))
    monkeypatch.setattr(plan_p2p._TimedSend, "is_completed", lambda self: False)  # the check can fail
    assert stage_peaks_on_completion(p, 64) == bound


class _Group:
    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size


@pytest.mark.parametrize("sp,tp,cp,dtype", [(False, 1, 1, torch.bfloat16), (True, 4, 1, torch.bfloat16),
                                            (False, 4, 2, torch.float32), (True, 2, 2, torch.float16)])
def test_tensor_bytes_match_megatrons_pipeline_shape(sp, tp, cp, dtype):
    from megatron.core.pipeline_parallel.schedules import get_tensor_shapes

    args = SimpleNamespace(seq_length=4096, micro_batch_size=3, hidden_size=2048, sequence_parallel=sp,
                           tensor_model_parallel_size=tp, context_parallel_size=cp, params_dtype=dtype)
    config = SimpleNamespace(variable_seq_lengths=False, sequence_parallel=sp, hidden_size=2048)
    (shape,) = get_tensor_shapes(seq_length=4096, micro_batch_size=3, decoder_seq_length=None, config=config,
                                 tp_group=_Group(tp), cp_group=_Group(cp))
    assert activation_tensor_bytes(args) == torch.empty(shape, dtype=dtype, device="meta").nbytes

"""No point-to-point operation stays outstanding over an evaluation or a checkpoint save.

Between two 2bw steps the next batch's warm-up activations are already on their way
downstream. Before an evaluation or a save (Megatron's loop calls it through the
save hook) every stage drains: it receives what its upstream neighbour has sent and
waits for its own sends. Checked here on real gloo ranks after every step: before
the drain the upstream stages hold unmatched sends (so there is something to drain),
after it none is left, and the drained activations feed their forwards: the run
still equals its one-step-delay twin (tolerance as tests/test_two_bw.py).
"""

import pytest

from tests.support.multiprocess import run_distributed
from tests.support.tiny_gpt import TinyGPT, microbatches, train, train_entry
from tests.support.trajectory import assert_same_trajectory

STEPS = 6
COMMON = dict(init_by_name=True, clip_grad=0.0, num_layers=4, global_batch_size=8, micro_batch_size=2)
RTOL = ATOL = 1e-6


def draining_entry(rank, world_size, spec, iterations, evaluate):
    """tiny_gpt's 2bw training with a drain (or an evaluation, which drains) after every step."""
    from megatron_async.pipeline import two_bw
    from tests.support.two_bw_trainer import evaluate_microbatches

    counts = []
    train_step = two_bw.TwoBWRunner.train_step

    def step_then_drain(self, step, data_for):
        out = train_step(self, step, data_for)
        before = self.pending_sends
        if evaluate:
            evaluate_microbatches(self, list(microbatches(spec, 10_000 + step)))
        else:
            self.drain()
        counts.append((before, self.pending_sends))
        return out

    two_bw.TwoBWRunner.train_step = step_then_drain  # this rank's process only
    result = train(spec, iterations, rank, world_size)
    result["drains"] = counts
    return result


@pytest.mark.parametrize("pp,evaluate", [(2, False), (4, True)])
def test_nothing_is_outstanding_after_a_drain_and_training_is_unchanged(pp, evaluate):
    (twin,) = run_distributed(train_entry, 1, TinyGPT(simulated_delay=1, **COMMON), STEPS)
    results = run_distributed(draining_entry, pp, TinyGPT(pp=pp, schedule="2bw", **COMMON), STEPS, evaluate)
    for r in results:
        assert len(r["drains"]) == STEPS
        assert all(after == 0 for _before, after in r["drains"]), (r["pp_rank"], r["drains"])
        if r["pp_rank"] < pp - 1:  # upstream stages have sent the next warm-up: there was something to drain
            assert all(before > 0 for before, _after in r["drains"]), (r["pp_rank"], r["drains"])
    assert_same_trajectory(twin, results, RTOL, ATOL)

"""The plan's microbatches in flight per stage (planning/in_flight.py), and its activations.

Under 2bw with --overlap-moe-expert-parallel-comm the deeper warm-up, 2(p-1-s)+1 forwards,
and a combined step's new forward beside the backward it runs hold 2(p-s) microbatches on
stage s: 2p on stage 0, twice 2bw's p. Without the flag, and for a schedule that is not our
runtime's, the plan keeps p - s. The activation term grows by exactly that factor, and the
point-to-point buffers are counted on the paired stream (which replays without error).
"""

from types import SimpleNamespace

import pytest

from megatron_async.planning.in_flight import microbatches_in_flight
from megatron_async.planning.plan import activation_bytes
from megatron_async.planning.send_buffers import stage_peaks


def _args(p: int, schedule="2bw", overlap=True, **over):
    base = dict(pipeline_model_parallel_size=p, pipeline_schedule=schedule, overlap_moe_expert_parallel_comm=overlap,
                seq_length=4096, micro_batch_size=1, num_experts=0, hidden_size=1024, recompute_granularity=None,
                context_parallel_size=1, sequence_parallel=False, tensor_model_parallel_size=1,
                params_dtype=SimpleNamespace(itemsize=2))
    return SimpleNamespace(**{**base, **over})


@pytest.mark.parametrize("p, m", [(2, 3), (4, 7), (4, 16), (8, 15)])
def test_the_deeper_warmup_holds_twice_the_microbatches(p, m):
    paired = microbatches_in_flight(_args(p), m)
    plain = microbatches_in_flight(_args(p, overlap=False), m)
    assert plain == [p - s for s in range(p)]
    assert paired == [2 * (p - s) for s in range(p)]
    assert paired[0] == 2 * p == 2 * plain[0]
    # a schedule without our runtime (Megatron's own) keeps the plain count with the flag
    assert microbatches_in_flight(_args(p, schedule="1f1b"), m) == plain
    assert microbatches_in_flight(_args(p, schedule=None), m) == plain


def test_the_activation_term_grows_with_the_microbatches_in_flight():
    p, m, layers = 4, 16, 6
    args = _args(p)
    paired, plain = microbatches_in_flight(args, m), microbatches_in_flight(_args(p, overlap=False), m)
    for s in range(p):
        with_flag = activation_bytes(args, s, layers, False, paired[s])
        assert with_flag == activation_bytes(args, s, layers, False, plain[s]) * paired[s] / plain[s]
        assert activation_bytes(args, s, layers, False) == activation_bytes(args, s, layers, False, plain[s])


def test_the_paired_stream_replays_for_the_send_buffers():
    p, m = 4, 8
    paired, plain = stage_peaks(p, m, paired=True), stage_peaks(p, m)
    assert len(paired) == p and all(peak.buffers >= 1 for peak in paired[:-1])
    assert paired != plain  # the replay reads the paired lists, not 2bw's own

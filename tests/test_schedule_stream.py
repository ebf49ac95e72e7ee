"""The 2bw lists streamed one batch at a time (schedules/stream_2bw.py) are the 2bw
generator's lists, for every stage, pipeline depth, microbatch count and run length
tried, also numbered from a resumed batch; the validator accepts them, and building
the stream does not depend on the run's length."""

import pytest

from megatron_async.schedules.gen_2bw import min_microbatches_2bw, two_bw
from megatron_async.schedules.stream_2bw import TEMPLATE_BATCHES, TwoBWStream, shift
from megatron_async.schedules.validator import validate

SHAPES = [(p, m) for p in range(1, 9) for m in sorted({min_microbatches_2bw(p), p, 2 * p + 1})]


@pytest.mark.parametrize("p, m", SHAPES)
def test_stream_equals_the_generators_lists(p, m):
    for n in (1, 2, TEMPLATE_BATCHES, TEMPLATE_BATCHES + 1, TEMPLATE_BATCHES + 2, 3 * TEMPLATE_BATCHES):
        full = two_bw(p, m, n)
        for first in (0, 7):
            assert TwoBWStream(p, m, n, first).lists() == [shift(a, first, m) for a in full], (p, m, n, first)


def test_the_comparison_can_fail():
    """Negative control: a run one batch longer, or numbered one batch later, is another list."""
    p, m, n = 4, 4, TEMPLATE_BATCHES + 3
    assert TwoBWStream(p, m, n).lists() != two_bw(p, m, n + 1)
    assert TwoBWStream(p, m, n, 1).lists() != two_bw(p, m, n)


@pytest.mark.parametrize("p, m", [(4, 3), (8, 16)])
def test_the_validator_accepts_streamed_lists(p, m):
    report = validate(TwoBWStream(p, m, 2 * TEMPLATE_BATCHES).lists())
    assert report is not None


def test_what_a_stream_holds_does_not_grow_with_the_run():
    """A 100k-batch stream holds the same template as a 6-batch one, and still gives the
    segment of its last batch (timings: bench/throughput/schedule_startup.py)."""
    def held(stream):
        return sum(len(seg) for segments, tail in stream._pieces for seg in segments + [tail])

    short, long = TwoBWStream(8, 16, TEMPLATE_BATCHES + 1), TwoBWStream(8, 16, 100_000)
    assert held(long) == held(short)
    last = long.segment(3, 99_999)
    assert last[-1].step == 99_999 and last == shift(short.segment(3, TEMPLATE_BATCHES), 100_000 - 6, 16)

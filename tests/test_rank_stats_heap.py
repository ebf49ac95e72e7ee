"""--rank-stats-dir records malloc's bytes in use and free next to RSS: in use flat while
RSS grows is memory the allocator keeps, in use growing is a leak (docs/benchmarks.md's soak)."""

import json

import pytest

from megatron_async.megatron_lm.observability.malloc_heap import heap_mb
from megatron_async.megatron_lm.observability.rank_stats import RankStats

needs_mallinfo2 = pytest.mark.skipif(not heap_mb(), reason="glibc's mallinfo2 is unavailable")


@needs_mallinfo2
def test_heap_in_use_follows_a_block_held_and_freed():
    size_mb = 64
    before = heap_mb()["heap_in_use_mb"]
    block = bytearray(size_mb * 2**20)
    held = heap_mb()["heap_in_use_mb"]
    del block
    after = heap_mb()["heap_in_use_mb"]
    assert held - before >= size_mb, (before, held)
    assert held - after >= size_mb, (held, after)


@needs_mallinfo2
def test_rank_stats_record_holds_rss_and_heap(tmp_path):
    stats = RankStats(str(tmp_path), rank=1)
    stats.iteration(0.25)
    stats.iteration(0.75)
    stats.flush(10, pending_sends=3)
    (record,) = [json.loads(line) for line in (tmp_path / "rank1.jsonl").read_text().splitlines()]
    assert record["iteration"] == 10 and record["s_per_iter"] == pytest.approx(0.5)
    assert record["pending_sends"] == 3
    assert record["rss_mb"] > 0
    assert record["heap_in_use_mb"] > 0 and record["heap_free_mb"] >= 0

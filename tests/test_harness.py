"""The multi-rank harness reports the failing rank and never hangs or leaks processes."""

import multiprocessing
import time

import pytest
import torch.distributed as dist

from megatron_async.testing.multiprocess import RankError, RanksTimedOut, run_distributed


def _rank_info(rank, world_size):
    return {"rank": rank, "world": dist.get_world_size(), "backend": dist.get_backend()}


def _rank1_raises(rank, world_size):
    if rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()  # rank 0 would wait forever for rank 1
    return rank


def _rank0_hangs(rank, world_size):
    if rank == 0:
        time.sleep(3600)
    return rank


def test_runs_every_rank_in_order():
    results = run_distributed(_rank_info, 3)
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert all(r["world"] == 3 and r["backend"] == "gloo" for r in results)


def test_failing_rank_is_reported_without_hanging():
    start = time.monotonic()
    with pytest.raises(RankError, match=r"rank 1 of 2 failed:(.|\n)*ValueError: boom on purpose"):
        run_distributed(_rank1_raises, 2, timeout_s=60)
    assert time.monotonic() - start < 30
    assert not multiprocessing.active_children()


def test_hanging_rank_times_out_and_is_killed():
    start = time.monotonic()
    with pytest.raises(RanksTimedOut, match=r"ranks \[0\] of 2"):
        run_distributed(_rank0_hangs, 2, timeout_s=8)
    assert time.monotonic() - start < 25
    assert not multiprocessing.active_children()

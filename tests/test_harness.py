"""The multi-rank harness reports the failing rank and never hangs or leaks processes."""

import multiprocessing
import time

import pytest
import torch.distributed as dist

from tests.support.multiprocess import RankError, RanksTimedOut, run_distributed


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
        run_distributed(_rank0_hangs, 2, timeout_s=5)  # rank 1 reports within a second or two
    assert time.monotonic() - start < 25
    assert not multiprocessing.active_children()


def test_warm_launch_stops_the_peers_of_a_failed_rank_and_names_it():
    """torchrun's contract, kept by the tests' launcher: one rank dies, the others are
    stopped, the status is non-zero and the output names the rank."""
    from tests.support.warm_launch import warm_run

    start = time.monotonic()
    proc = warm_run("tests.support.rank_exit", ["1", "3"], nproc=3, timeout_s=120)
    assert time.monotonic() - start < 60  # the peers sleep for an hour unless stopped
    assert proc.returncode == 3, proc.stdout
    assert "rank 1: exiting with 3 on purpose" in proc.stdout
    assert "warm_launch: rank 1 of 3 failed (exit code 3)" in proc.stdout
    assert "rank 0 of 3 stopped (signal SIGTERM)" in proc.stdout and "rank 2 of 3 stopped (signal SIGTERM)" in proc.stdout
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("rank")]


def test_warm_launch_lets_the_peers_of_a_failed_rank_exit_on_their_own_when_asked():
    """With peers_exit_s, a rank that stops a second after its peer exits with its own
    code, as the exit-report tests need (tests/test_step_end_waits.py); without it (the
    negative control) torchrun's rule stops it."""
    from tests.support.warm_launch import warm_run

    own = warm_run("tests.support.rank_exit", ["1", "3", "1", "4"], nproc=2, timeout_s=60, peers_exit_s=30)
    assert own.returncode == 3, own.stdout  # the first rank to fail is the root cause, as in torchrun
    assert "rank 0: exiting with 4 after 1 s" in own.stdout, own.stdout
    assert "rank 0 of 2 failed (exit code 4)" in own.stdout and "stopped" not in own.stdout, own.stdout
    stopped = warm_run("tests.support.rank_exit", ["1", "3", "30", "4"], nproc=2, timeout_s=60)
    assert "rank 0 of 2 stopped (signal SIGTERM)" in stopped.stdout, stopped.stdout
    assert "rank 0: exiting" not in stopped.stdout, stopped.stdout


def test_warm_launch_times_out_naming_the_ranks_still_running():
    from tests.support.warm_launch import warm_run

    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] of 2 did not finish within 3 s"):
        warm_run("tests.support.rank_exit", ["7", "0"], nproc=2, timeout_s=3)  # both sleep
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("rank")]


def test_a_warm_jobs_rendezvous_port_is_held_by_its_launcher_from_the_start():
    """As torchrun's agent: the launcher hosts the job's store, so no other job can take
    its port before rank 0 would have bound it (two jobs of two pytest workers once met
    on one port; one failed with EADDRINUSE, the other hung). Here the ranks sleep
    without a process group: before, the port was free until rank 0 bound it."""
    import socket

    from tests.support.warm_launch import WarmJob

    job = WarmJob("tests.support.rank_exit", ["7", "0"], 2)
    try:
        with socket.socket() as sock, pytest.raises(OSError, match="in use"):
            sock.bind(("", job.port))
    finally:
        job.kill()


def test_rendezvous_ports_are_below_the_ephemeral_range():
    """The store's port is one no connection can be handed meanwhile (the EADDRINUSE of
    two pytest workers): below the kernel's ephemeral range, free, and not the same
    sequence twice (the choice is not seeded by tests that seed `random`)."""
    import random
    import socket

    from tests.support.multiprocess import _ephemeral_low, free_port

    low = _ephemeral_low()
    if low < 2048:
        pytest.skip(f"the ephemeral range starts at {low}: free_port takes the kernel's choice here")
    state = random.getstate()
    try:
        random.seed(0)
        first = [free_port() for _ in range(20)]
        random.seed(0)
        second = [free_port() for _ in range(20)]
    finally:
        random.setstate(state)
    assert all(1024 <= p < low for p in first + second), (low, first)
    assert first != second
    for port in first[:3]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", port))

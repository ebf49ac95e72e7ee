"""The CPU emulation of NCCL (megatron_async/cpu_nccl.py) on real gloo ranks: each case
is a program that hangs on NCCL, or one that does not, and the emulation must tell them
apart (failing, naming the wait, where NCCL would hang).

- Lazy communicators: a pair's first unbatched point-to-point operation blocks until
  the peer's first on that pair. A program whose first operation on one group waits
  for a message the peer sends on another group only later fails, naming the pair;
  with eager communicators (device_id given) the same program completes.
- Whole-device waits wait for posted receives and asynchronous collectives as for
  sends; a host group (backend="gloo") is no device work (the negative control).
- Eager communicators run a group's operations in posting order: a send posted
  behind a receive does not complete before it.
"""

import datetime
import os

import pytest

from tests.support.multiprocess import run_distributed

WAIT_S = 3  # the emulated NCCL waits' limit here: a matched operation takes milliseconds


def _setup(eager: bool):
    import torch.distributed as dist

    os.environ["MEGATRON_ASYNC_CPU_SEND_WAIT_S"] = str(WAIT_S)
    os.environ["MEGATRON_ASYNC_CPU_NCCL_EAGER"] = "1" if eager else "0"
    return dist


def _first_contact_entry(rank, world_size, eager):
    """Rank 0's first operation with rank 1 on group A is a receive that rank 1 sends
    only after a message on group B, which rank 0 sends after its receive is posted."""
    import torch

    from megatron_async.cpu_nccl import FirstContactError

    dist = _setup(eager)
    a, b = dist.new_group([0, 1]), dist.new_group([0, 1])
    data = torch.zeros(4)
    try:
        if rank == 0:
            work = dist.irecv(data, 1, group=a)
            dist.send(torch.ones(1), 1, group=b)
            work.wait()
        else:
            dist.recv(torch.zeros(1), 0, group=b)
            dist.send(torch.full((4,), 7.0), 0, group=a)
    except FirstContactError as err:
        return str(err)
    return data.tolist() if rank == 0 else "ok"


def test_a_first_contact_that_waits_for_later_work_fails_naming_the_pair():
    results = run_distributed(_first_contact_entry, 2, False, timeout_s=60)
    assert "rank 0's first point-to-point operation with rank 1" in results[0], results
    assert f"waited {WAIT_S} s for rank 1's first on that pair" in results[0], results


def test_with_eager_communicators_the_same_program_completes():
    assert run_distributed(_first_contact_entry, 2, True, timeout_s=60) == [[7.0] * 4, "ok"]


def _device_wait_entry(rank, world_size, what, host_group):
    """Rank 0 posts a receive (or an asynchronous all-reduce) on group A, waits for the
    whole device, and only then sends rank 1 the message on group B after which rank 1
    posts its side on A."""
    import torch

    from megatron_async.cpu_nccl import DeviceWaitError

    dist = _setup(eager=False)
    a = dist.new_group([0, 1], backend="gloo") if host_group else dist.new_group([0, 1])
    b = dist.new_group([0, 1])
    for group in (a, b):  # both pairs' communicators exist: only the device wait is tested
        if rank == 0:
            dist.send(torch.zeros(1), 1, group=group)
        else:
            dist.recv(torch.zeros(1), 0, group=group)
    data = torch.zeros(4)
    if rank == 0:
        work = (dist.irecv(data, 1, group=a) if what == "receive"
                else dist.all_reduce(data, group=a, async_op=True))
        error = None
        try:
            torch.cuda.empty_cache() if what == "receive" else torch.cuda.synchronize()
        except DeviceWaitError as err:
            error = str(err)
        dist.send(torch.ones(1), 1, group=b)  # the wait gave up without the work: it completes now
        work.wait()
        return error
    dist.recv(torch.zeros(1), 0, group=b)
    if what == "receive":
        dist.send(torch.ones(4), 0, group=a)
    else:
        dist.all_reduce(torch.ones(4), group=a)
    return None


@pytest.mark.parametrize("what", ["receive", "all_reduce"])
def test_a_whole_device_wait_waits_for_posted_receives_and_collectives(what):
    error, _ = run_distributed(_device_wait_entry, 2, what, False, timeout_s=60)
    assert error is not None, "the whole-device wait returned with device work its peer had not posted for"
    call = "empty_cache" if what == "receive" else "synchronize"
    assert f"torch.cuda.{call} waited {WAIT_S} s for" in error, error
    assert ("point-to-point receive of 16 bytes from rank 1" if what == "receive"
            else "asynchronous all_reduce on group") in error, error


@pytest.mark.parametrize("what", ["receive", "all_reduce"])
def test_negative_control_a_host_groups_operations_are_no_device_work(what):
    assert run_distributed(_device_wait_entry, 2, what, True, timeout_s=60) == [None, None]


def _eager_order_entry(rank, world_size, eager):
    """On one group rank 0 posts [receive from 1, send to 1] and rank 1 [receive from 0,
    send to 0], rank 1 sending only after rank 0's send completed: one stream per group
    under eager communicators makes rank 0's send wait for its receive, a deadlock."""
    import torch

    dist = _setup(eager)
    a, b = dist.new_group([0, 1]), dist.new_group([0, 1])
    if rank == 0:
        got = torch.zeros(1)
        first = dist.irecv(got, 1, group=a)
        second = dist.isend(torch.ones(1), 1, group=a)
        try:
            second.wait(datetime.timedelta(seconds=WAIT_S))
            done = True
        except RuntimeError:
            done = False
        dist.send(torch.ones(1), 1, group=b)
        first.wait()
        return done
    dist.recv(torch.zeros(1), 0, group=a)
    dist.recv(torch.zeros(1), 0, group=b)
    dist.send(torch.ones(1), 0, group=a)
    return None


@pytest.mark.parametrize("eager", [False, True], ids=["lazy", "eager"])
def test_eager_communicators_complete_a_groups_operations_in_posting_order(eager):
    done, _ = run_distributed(_eager_order_entry, 2, eager, timeout_s=60)
    assert done is (not eager)

"""What NCCL does that gloo does not, modelled on the CPU for the CUDA emulation (cpu.py).

CPU tests must hang (here: fail, naming the wait) where a GPU cluster would. Three
behaviours of NCCL under torch's ProcessGroupNCCL (torch 2.13) matter to a pipeline:

- **Device work.** A posted send, receive or asynchronous collective is a kernel on
  the GPU until its peers post theirs (a send larger than NCCL's buffer included), and
  `torch.cuda.synchronize`, `empty_cache` (cudaFree) and the caching allocator's retry
  after an out-of-memory wait for every kernel on the device. gloo's work runs on its
  own threads and never holds anything else. Here every such operation this process
  posts is tracked, and an emulated whole-device wait waits for all of it: one its
  peers never post for within MEGATRON_ASYNC_CPU_SEND_WAIT_S seconds (default 600,
  NCCL's watchdog) raises DeviceWaitError naming it, where NCCL would hang.
- **Lazy communicators.** Megatron-Core 0.19.2 calls `init_process_group` without
  `device_id`, so torch makes communicators lazily. An unbatched send or receive makes
  a two-rank communicator for its (group, pair) at the pair's first point-to-point
  operation, and the host blocks in its creation until the peer makes its own first
  point-to-point operation on that pair. A collective on the group makes the group's
  communicator, not the pair's. Here the first unbatched operation of a pair meets its
  peer's first on the job's store; FirstContactError names a pair whose peer never came.
- **Eager communicators.** With `device_id` given (or MEGATRON_ASYNC_CPU_NCCL_EAGER=1
  here), torch makes the group's communicator at its creation and runs unbatched
  point-to-point operations on it: no pair is made and nobody blocks at a first
  contact, but every operation of a group runs on one stream, in posting order. Here
  an operation of such a group completes only after every earlier one of that group
  (its start is not held back: gloo moves the data at once).

Batched operations (`batch_isend_irecv`) use the group's communicator in both modes,
like a collective, and take part in neither pair rule. Groups made with an explicit
`backend="gloo"` are host groups (CPU tensors, no device work) on NCCL clusters too.

Shipped with cpu.py, which installs it whenever the emulation activates: every command
that runs the emulation (``make demo``, the image's CI smoke ``make image-smoke``, the
launcher on a machine without CUDA) runs these rules, so a CPU run fails where a GPU
run would hang.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import threading
from typing import Any

from megatron_async.patch_table import Patch, Scope

SEND_WAIT_ENV = "MEGATRON_ASYNC_CPU_SEND_WAIT_S"  # how long an emulated NCCL wait waits before failing
EAGER_ENV = "MEGATRON_ASYNC_CPU_NCCL_EAGER"  # 1: model eager communicators (init_process_group(device_id=...))
STORE_PREFIX = "megatron_async/nccl_pair"


class DeviceWaitError(RuntimeError):
    """An emulated whole-device wait found work its peers never posted for: a hang on NCCL."""



class FirstContactError(RuntimeError):
    """A pair's first point-to-point operation never met its peer's: a hang on NCCL."""


def wait_limit_s() -> float:
    return float(os.environ.get(SEND_WAIT_ENV, "600"))


class _Posted:
    """One posted operation: waitable more than once (gloo counts a send's or receive's
    waits, so the whole-device wait and the owner cannot both wait on the plain work),
    and, on an eager group, complete only after the group's earlier operations. A wait
    with a time limit runs in a thread of its own and gives up without touching the
    work (gloo closes the pair when its own timed wait expires; NCCL would wait on)."""

    def __init__(self, work, kind: str, peer, size: int, group: str, before: list):
        self._work, self.kind, self.peer, self.size, self.group = work, kind, peer, size, group
        self._before = before  # eager groups: the group's operations posted earlier
        self._done = False
        self._lock, self._started = threading.Lock(), False
        self._finished = threading.Event()
        self._error: BaseException | None = None

    def _wait_unbounded(self) -> None:
        try:
            for earlier in self._before:
                earlier.wait()
            self._work.wait()
        except BaseException as err:  # noqa: BLE001 - handed to the waiting caller
            self._error = err
        finally:
            self._finished.set()

    def wait(self, timeout=None) -> bool:
        if self._done:
            return True
        with self._lock:  # one real wait per operation, whichever thread asks first
            first, self._started = not self._started, True
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
        if first and seconds is None:
            self._wait_unbounded()
        elif first:
            threading.Thread(target=self._wait_unbounded, daemon=True).start()
        if not self._finished.wait(seconds):
            raise RuntimeError(f"not complete after {seconds:g} s")
        if self._error is not None:
            raise self._error
        self._done, self._before = True, []
        return True

    def is_completed(self) -> bool:
        if self._done:
            return True
        if self._started:
            return self._finished.is_set() and self._error is None
        return all(e.is_completed() for e in self._before) and self._work.is_completed()

    def describe(self) -> str:
        if self.kind == "send":
            return (f"a point-to-point send of {self.size} bytes to rank {self.peer} that its receiver never "
                    "posted for: on NCCL a send larger than its buffer (a real activation) runs on the GPU until "
                    "it is received")
        if self.kind == "recv":
            return (f"a point-to-point receive of {self.size} bytes from rank {self.peer} that its sender never "
                    "sent: on NCCL a posted receive runs on the GPU until its data arrives")
        return (f"an asynchronous {self.kind} on group {self.group} that not every rank of the group posted: on "
                "NCCL a collective runs on the GPU until all its ranks have posted it")

    def __getattr__(self, name):
        return getattr(self._work, name)


class EmulatedNccl:
    """This process's emulated device and communicators (one per process, as a GPU is)."""

    def __init__(self):
        self.posted: list[_Posted] = []
        self.contacts: set = set()  # (group, low rank, high rank) whose communicator exists
        self.host_groups: set = set()  # names of groups made with backend="gloo"
        self.by_group: dict = {}  # eager mode: group name -> its operations not known complete
        self._local = threading.local()

    # --- what is posted ---------------------------------------------------------
    def track(self, work, kind: str, peer, size: int, group) -> Any:
        if work is None or type(work).__name__ == "_IllegalWork":  # inside a coalescing manager:
            return work  # the coalesced batch's own work is what completes
        name = group_name(group)
        if name in self.host_groups:
            return work
        eager = self.eager()
        before = [w for w in self.by_group.get(name, []) if not w._done] if eager else []
        posted = _Posted(work, kind, peer, size, name, before)
        self.posted = [w for w in self.posted if not w._done]
        self.posted.append(posted)
        if eager:
            self.by_group[name] = before + [posted]
        return posted

    def outstanding(self, kind: str | None = None) -> int:
        return sum(1 for w in self.posted if not w.is_completed() and (kind is None or w.kind == kind))

    def wait_all(self, what: str) -> None:
        """A whole-device wait: every operation posted, each within the limit."""
        limit = wait_limit_s()
        pending, self.posted = self.posted, []
        for posted in pending:
            if posted._done:
                continue
            try:
                posted.wait(datetime.timedelta(seconds=limit))
            except RuntimeError as err:
                raise DeviceWaitError(f"megatron-async (CPU emulation of NCCL): {what} waited {limit:g} s for "
                                      f"{posted.describe()}, so this whole-device wait would hang ({err})") from None

    # --- communicators ------------------------------------------------------------
    def eager(self) -> bool:
        if os.environ.get(EAGER_ENV) == "1":
            return True
        import torch.distributed as dist

        default = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
        return getattr(default, "bound_device_id", None) is not None

    @contextlib.contextmanager
    def batched(self):
        self._local.batched = getattr(self._local, "batched", 0) + 1
        try:
            yield
        finally:
            self._local.batched -= 1

    def first_contact(self, group, peer: int) -> None:
        """Before an unbatched point-to-point operation with global rank `peer`: in lazy
        mode the pair's first one blocks until the peer's first on the same pair."""
        import torch.distributed as dist

        rank = dist.get_rank()
        name = group_name(group)
        pair = (name, min(rank, peer), max(rank, peer))
        if (pair in self.contacts or peer == rank or getattr(self._local, "batched", 0)
                or name in self.host_groups or self.eager()):
            return
        store = dist.distributed_c10d._get_default_store()
        key = f"{STORE_PREFIX}/{name}/{pair[1]}:{pair[2]}"
        store.set(f"{key}/{rank}", "1")
        limit = wait_limit_s()
        try:
            store.wait([f"{key}/{peer}"], datetime.timedelta(seconds=limit))
        except Exception as err:  # the store's timeout (DistStoreError, RuntimeError)
            raise FirstContactError(
                f"megatron-async (CPU emulation of NCCL): rank {rank}'s first point-to-point operation with rank "
                f"{peer} on group {name} waited {limit:g} s for rank {peer}'s first on that pair: torch makes the "
                "pair's NCCL communicator there and blocks the host until both have come, so this would hang "
                f"({type(err).__name__})") from None
        self.contacts.add(pair)


def group_name(group) -> str:
    import torch.distributed as dist

    group = group if group is not None else dist.group.WORLD
    return getattr(group, "group_name", None) or str(id(group))


def _peer(group, dst, group_dst):
    import torch.distributed as dist

    if dst is not None:
        return dst
    return dist.get_global_rank(group if group is not None else dist.group.WORLD, group_dst)


def _nbytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _point_to_point(nccl: EmulatedNccl, original, kind: str, blocking: bool):
    """isend/irecv (tracked) or send/recv (complete on return), with the pair's first contact.
    torch's own signatures: (tensor, dst|src, group, tag, group_dst|group_src)."""

    @functools.wraps(original)
    def op(tensor, peer=None, group=None, tag=0, group_peer=None):
        target = None if peer is None and group_peer is None else _peer(group, peer, group_peer)
        if target is not None:  # a receive from any source has no pair (NCCL has no such receive)
            nccl.first_contact(group, target)
        result = original(tensor, peer, group, tag, group_peer)
        if blocking:
            return result
        return nccl.track(result, kind, target, _nbytes(tensor), group)

    op.__wrapped__ = original
    return _with_torch_names(op, kind)


def _with_torch_names(op, kind: str):
    """`op` called as torch's function is: dst/group_dst for sends, src/group_src for receives."""
    peer, group_peer = ("dst", "group_dst") if kind == "send" else ("src", "group_src")

    @functools.wraps(op)
    def named(tensor, *args, **kwargs):
        if peer in kwargs:
            kwargs["peer"] = kwargs.pop(peer)
        if group_peer in kwargs:
            kwargs["group_peer"] = kwargs.pop(group_peer)
        return op(tensor, *args, **kwargs)

    return named


def _collective(nccl: EmulatedNccl, original, name: str):
    """An asynchronous collective is device work until every rank has posted it."""

    @functools.wraps(original)
    def op(*args, **kwargs):
        result = original(*args, **kwargs)
        if not kwargs.get("async_op"):
            return result
        return nccl.track(result, name, None, 0, kwargs.get("group"))

    op.__wrapped__ = original
    return op


def _batch(nccl: EmulatedNccl, original):
    @functools.wraps(original)
    def batch_isend_irecv(p2p_op_list):
        with nccl.batched():
            return original(p2p_op_list)

    batch_isend_irecv.__wrapped__ = original
    return batch_isend_irecv


def _new_group(nccl: EmulatedNccl, original):
    """Remembers host groups (backend="gloo"): no device work, no NCCL communicator."""

    @functools.wraps(original)
    def new_group(*args, **kwargs):
        group = original(*args, **kwargs)
        backend = kwargs.get("backend", args[2] if len(args) > 2 else None)
        if group is not None and backend is not None and str(backend).lower() == "gloo":
            nccl.host_groups.add(group_name(group))
        return group

    new_group.__wrapped__ = original
    return new_group


class _DoneWork:
    """What an async collective returns when it already ran to completion."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _uneven_all_gather(original):
    """gloo's all_gather requires equal sizes; NCCL accepts unequal ones, and
    Megatron's LayerWiseDistributedOptimizer.allgather_params relies on it (each
    data-parallel rank gathers the whole parameters it owns, of different sizes).
    Pad every input to the largest size, gather, and trim each output."""
    import torch

    @functools.wraps(original)
    def all_gather(tensor_list, tensor, group=None, async_op=False):
        sizes = [t.numel() for t in tensor_list]
        if len(set(sizes)) <= 1:
            return original(tensor_list, tensor, group=group, async_op=async_op)
        longest = max(sizes)
        source = torch.zeros(longest, dtype=tensor.dtype, device=tensor.device)
        source[: tensor.numel()] = tensor.reshape(-1)
        padded = [torch.empty_like(source) for _ in sizes]
        original(padded, source, group=group)
        for out, full, size in zip(tensor_list, padded, sizes):
            out.view(-1).copy_(full[:size])
        return _DoneWork() if async_op else None

    return all_gather


COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
               "all_to_all_single", "reduce", "barrier")


def patches(nccl: EmulatedNccl) -> tuple:
    """The torch.distributed functions routed through `nccl`, each under both module names
    (P2POp checks its op against distributed_c10d's isend/irecv): one entry per function,
    so all_gather is wrapped once (unequal sizes, then tracked) whatever else is installed."""
    both = dict(scope=Scope.CPU, also=("torch.distributed.distributed_c10d",))
    table = [Patch("torch.distributed", name, f"{kind}: {'complete on return' if blocking else 'tracked'}, "
                   "with the pair's first contact", functools.partial(_point_to_point, nccl, kind=kind,
                                                                      blocking=blocking), **both)
             for name, kind, blocking in (("isend", "send", False), ("irecv", "recv", False),
                                          ("send", "send", True), ("recv", "recv", True))]
    for name in COLLECTIVES:
        why = "an asynchronous collective is device work until every rank posted it"
        make = functools.partial(_collective, nccl, name=name)
        if name == "all_gather":
            why += "; unequal sizes as NCCL accepts them (Megatron's layer-wise optimizer)"
            make = functools.partial(_uneven_then_tracked, nccl)
        table.append(Patch("torch.distributed", name, why, make, **both))
    table.append(Patch("torch.distributed", "batch_isend_irecv", "batched operations take part in no pair rule",
                       functools.partial(_batch, nccl), **both))
    table.append(Patch("torch.distributed", "new_group", "host groups (backend='gloo') are remembered",
                       functools.partial(_new_group, nccl), **both))
    return tuple(table)


def _uneven_then_tracked(nccl: EmulatedNccl, original):
    return _collective(nccl, _uneven_all_gather(original), "all_gather")

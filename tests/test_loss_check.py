"""The last stage checks its losses after the step without reading them one by one.

`TwoBWRunner.train_step` used to call `float()` on every microbatch's loss after the
optimizer step: on a GPU each read waits for everything queued, the optimizer and
stash kernels included, m times a step. Now one finiteness flag is made on the
device before the step and read after it (`non_finite.LossFlag`). Recorded with a
dispatch mode on the last stage of a PP=2 2bw run: no host read of a loss tensor's
storage inside `train_step`; the former check reads each microbatch's loss (negative
control). That a non-finite loss still stops the run at its own iteration is
tests/test_megatron_loop.py's non-finite test.
"""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.support.multiprocess import run_distributed
from tests.support.tiny_gpt import TinyGPT

STEPS = 3


class _HostReads(TorchDispatchMode):
    """The storage of every tensor read to the host (`.item()`, `float()`, `bool()`).

    Storages are matched by address, so each read storage is held until the step's
    losses are compared: a freed one could otherwise hand its address to a loss made
    later in the step, and a read of an unrelated scalar would count as a loss read.
    """

    def __init__(self):
        super().__init__()
        self.storages = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten._local_scalar_dense:
            self.storages.append(args[0].untyped_storage())
        return func(*args, **(kwargs or {}))


def _reads_entry(rank, world_size, former):
    from megatron_async.pipeline import two_bw
    from megatron_async.pipeline.non_finite import check_finite, report_losses
    from tests.support import tiny_gpt

    real = two_bw.TwoBWRunner.train_step

    def former_train_step(self, step, data_for):  # a check without LossFlag, reading each loss, on the same executor
        reports, result = self.executor.train_step(step, data_for)
        check_finite(step + 1, self.links.stage, None, report_losses(reports))
        return reports, result

    reads = []

    def recorded(self, step, data_for):
        with _HostReads() as mode:
            reports, result = (former_train_step if former else real)(self, step, data_for)
        losses = {v.untyped_storage().data_ptr() for r in reports for v in r.values() if isinstance(v, torch.Tensor)}
        reads.append((len(losses), sum(storage.data_ptr() in losses for storage in mode.storages)))
        return reports, result

    two_bw.TwoBWRunner.train_step = recorded
    tiny_gpt.train(TinyGPT(pp=2, schedule="2bw", num_layers=2), STEPS, rank, world_size)
    return reads


def test_the_last_stage_reads_no_loss_to_the_host_in_its_step():
    _first, last = run_distributed(_reads_entry, 2, False)
    assert len(last) == STEPS and all(tensors > 0 for tensors, _reads in last), last
    assert all(reads == 0 for _tensors, reads in last), last
    # negative control: the former check reads every microbatch's loss after the step
    _first, former = run_distributed(_reads_entry, 2, True)
    assert all(reads >= tensors > 0 for tensors, reads in former), former

"""`python -m megatron_async.testing.step_end_entry ARGS`: megatron_async.launch for the
step-end tests (tests/test_step_end_waits.py), with two switches read from the
environment:

- MEGATRON_ASYNC_TEST_WITHOUT_STEP_END_RECEIVE=1: the 2bw runtime as it was before
  its step-end receive (a stage received a later batch's activation only in its next
  step): the negative control, whose hang the CPU emulation of NCCL must catch;
- MEGATRON_ASYNC_TEST_QUICK_SNIFF=1: Megatron's `--gpu-sniff-test-interval` check with
  its GEMM and bandwidth benchmarks (80 s on the CPU) replaced by one all-reduce over
  all ranks and a device synchronisation, keeping what matters to the pipeline:
  Megatron's barrier-timed bracket around all-rank collectives.
"""

import os
import sys

import torch


def _train_step_without_early_receive(self, step: int):
    found, result = self._run_until(step)
    if not found:
        raise RuntimeError(f"stage {self.links.stage}: no OptimizerStep({step}) left in its schedule")
    return self._reports.pop(step, []), result


def _quick_sniff(tag="", pg_collection=None):
    value = torch.ones(1)
    torch.distributed.all_reduce(value)  # over all ranks, as the real check's all-reduce benchmark
    torch.cuda.synchronize()


if __name__ == "__main__":
    if os.environ.get("MEGATRON_ASYNC_TEST_WITHOUT_STEP_END_RECEIVE") == "1":
        from megatron_async.pipeline.executor import StageExecutor

        StageExecutor.train_step = _train_step_without_early_receive
    if os.environ.get("MEGATRON_ASYNC_TEST_QUICK_SNIFF") == "1":
        from megatron.training import gpu_sniff_test

        gpu_sniff_test.run_gpu_sniff_test = _quick_sniff
    from megatron_async.launch import main

    sys.exit(main())

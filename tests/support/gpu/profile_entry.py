"""`python -m tests.support.gpu.profile_entry ARGS` under torchrun: the ranks of
shared_gpu_entry (several on one GPU, each its own NCCL host), with torch.profiler around
some training iterations.

    MEGATRON_ASYNC_PROFILE_DIR=DIR MEGATRON_ASYNC_PROFILE_ITERATIONS=FIRST:STOP

Each rank profiles Megatron's train_step calls FIRST to STOP-1 (counted from 1): host ops,
and CUDA kernels with their streams where there is a GPU; it waits for the device before
the profiler stops, and writes DIR/trace_rank<R>.json (Chrome trace format) before the next
iteration, so the iterations after STOP run unprofiled. Then runs megatron_async.launch
with ARGS.

Without CUDA (the CPU dry run) it profiles with the autograd profiler without Kineto, host
ops alone: Kineto's profiler without a CUDA driver, in these gloo ranks under the CUDA
emulation, corrupted the heap (`free(): invalid next size`, or a segmentation fault at a
later garbage collection, with or without --overlap-moe-expert-parallel-comm; not seen in a
lone process), where the autograd profiler ran them to their end.
"""

from __future__ import annotations

import functools
import os
import sys

DIR_ENV, ITERATIONS_ENV = "MEGATRON_ASYNC_PROFILE_DIR", "MEGATRON_ASYNC_PROFILE_ITERATIONS"


def _profiled_train_step(original, first: int, stop: int, path: str):
    import torch

    state = {"calls": 0, "profiler": None}
    cuda = torch.cuda.is_available()

    def start():
        if cuda:
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            state["profiler"] = torch.profiler.profile(activities=activities)
            state["profiler"].start()
        else:  # host ops alone, without Kineto (module docstring)
            state["profiler"] = torch.autograd.profiler.profile(use_kineto=False)
            state["profiler"].__enter__()

    def stop_and_write():
        if cuda:
            torch.cuda.synchronize()  # every kernel of the profiled steps ends inside the profile
            state["profiler"].stop()
        else:
            state["profiler"].__exit__(None, None, None)
        state["profiler"].export_chrome_trace(path)
        state["profiler"] = None

    @functools.wraps(original)
    def train_step(*args, **kwargs):
        state["calls"] += 1
        if state["calls"] == first:
            start()
        try:
            return original(*args, **kwargs)
        finally:
            if state["calls"] == stop - 1 and state["profiler"] is not None:
                stop_and_write()

    return train_step


def main() -> int:
    import torch

    from megatron_async import launch
    from megatron_async.megatron_lm.adapter.hooks import install
    from tests.support.gpu.shared_gpu_entry import shared_gpu_environment

    if torch.cuda.is_available():
        os.environ.update(shared_gpu_environment(os.environ.get("RANK", "0")))
    install()  # the plugin's hooks first, so the profiler wraps what Megatron calls
    directory = os.environ.get(DIR_ENV)
    if directory:
        import megatron.training.training as training

        first, stop = (int(x) for x in os.environ[ITERATIONS_ENV].split(":"))
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"trace_rank{os.environ.get('RANK', '0')}.json")
        training.train_step = _profiled_train_step(training.train_step, first, stop, path)
    return launch.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())

"""Each rank's point-to-point sends left unwaited at exit, written for tests/test_step_end_waits.py.

With MEGATRON_ASYNC_TEST_EXIT_REPORT=DIR, `install()` (tests/support/step_end_entry.py) makes
megatron_async.launch write DIR/rank<R>.json, {"rank": R, "outstanding_sends": N}, once: before
the process group is destroyed after training (which would abort what is left), after a run
that raised or exited, and at interpreter exit for anything else. The count is the CPU
emulation's (`megatron_async.cpu.outstanding_sends`): gloo reports a send complete only once
someone waits on it, which is what NCCL would leave running on the GPU.
"""

import atexit
import json
import os

EXIT_REPORT_ENV = "MEGATRON_ASYNC_TEST_EXIT_REPORT"
_written = False


def write() -> None:
    """This rank's report, the first time it is called (the earliest count is the one to keep)."""
    global _written
    from megatron_async import cpu

    folder = os.environ.get(EXIT_REPORT_ENV)
    if not folder or _written or not cpu.is_active():
        return
    _written = True
    rank = os.environ.get("RANK", "0")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"rank{rank}.json"), "w", encoding="utf-8") as out:
        json.dump({"rank": int(rank), "outstanding_sends": cpu.outstanding_sends()}, out)


def install() -> None:
    """Wrap the launcher's end of training and its run so that each writes the report first."""
    import torch.distributed as dist

    from megatron_async import launch

    finish, run_and_finish = launch._finish, launch._run_and_finish

    def finish_after_report() -> None:
        if dist.is_initialized():
            write()
        finish()

    def run_then_report(script, rest):
        try:
            return run_and_finish(script, rest)
        finally:
            write()

    launch._finish, launch._run_and_finish = finish_after_report, run_then_report
    atexit.register(write)

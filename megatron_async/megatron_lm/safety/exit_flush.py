"""What a stop of ours would lose by leaving through `os._exit`, done before it.

Our refusals and stops (a non-finite loss, a lost peer) end the process with
`os._exit`, since gloo's and NCCL's threads can abort a normal exit and replace our
exit code. `os._exit` runs no atexit handler: Megatron's TensorBoard writer would
drop the events still in its queue (up to --tensorboard-queue-size, written every two
minutes) and the W&B run would stay "running". Both are flushed here. An asynchronous
checkpoint save still being written (--async-save, Megatron's 1F1B; 2bw refuses it)
cannot be finalized: that is a collective over all ranks, which a stopping rank cannot
count on; it is named instead, so nobody takes its folder for a whole checkpoint.
"""

from __future__ import annotations

import contextlib
import sys


def before_exit(code: int) -> None:
    """Flush TensorBoard and W&B; name an unfinished asynchronous save. Never raises."""
    try:
        from megatron.training import async_utils, global_vars
    except ImportError:
        return
    writer = getattr(global_vars, "_GLOBAL_TENSORBOARD_WRITER", None)
    if writer is not None:
        with contextlib.suppress(Exception):
            writer.flush()
    wandb = getattr(global_vars, "_GLOBAL_WANDB_WRITER", None)
    if wandb is not None:
        with contextlib.suppress(Exception):
            wandb.finish(exit_code=code)
    with contextlib.suppress(Exception):
        if not async_utils.is_empty_async_queue():  # one write: ranks sharing an output keep whole lines
            sys.stderr.write("megatron-async: an asynchronous checkpoint save (--async-save) was still being written "
                             "and is not finalized: its folder is incomplete and Megatron's tracker file still names "
                             "the checkpoint before it, which is the one to resume from\n")
            sys.stderr.flush()

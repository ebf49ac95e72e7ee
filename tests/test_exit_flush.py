"""A stop of ours leaves through os._exit (megatron_lm/safety/exit_flush.py): what Megatron's
writers hold is flushed first, and an unfinished asynchronous save is named.

A diverging 2bw run (PP=2, the learning rate far too high) stops on its non-finite
check with exit 3; the event file of Megatron's TensorBoard writer (last rank,
--tensorboard-dir) must hold every iteration the run logged. Whether an os._exit loses
the writer's queue is a race with its writer thread, so the flush itself is checked in
one process against stand-in writers (W&B finished with the exit code), and the
asynchronous-save line with Megatron's queue reporting a save in flight.
"""

import re

from tests.support.loop_runs import CPU, MODEL, TRAIN
from tests.support.warm_launch import warm_run

DIVERGE = ["--lr", "1e3", "--clip-grad", "0", "--lr-decay-style", "constant", "--train-iters", "60",
           "--no-check-for-nan-in-loss-and-grad", "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw"]
TIMEOUT_S = 240


def _loss_events(folder) -> int:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    count = 0
    for path in folder.rglob("events.out.tfevents.*"):
        events = EventAccumulator(str(path))
        events.Reload()
        if "lm loss" in events.Tags().get("scalars", []):
            count += len(events.Scalars("lm loss"))
    return count


def test_a_non_finite_stop_keeps_every_logged_iteration_in_tensorboard(tmp_path):
    board = tmp_path / "tb"
    proc = warm_run("tests.support.step_end_entry",
                    ["--gpt", *CPU, *MODEL, *TRAIN, *DIVERGE, "--tensorboard-dir", str(board)], 2, TIMEOUT_S,
                    peers_exit_s=30)
    assert proc.returncode == 3, proc.stdout[-3000:]
    assert "stopped: iteration" in proc.stdout, proc.stdout[-3000:]
    logged = len(re.findall(r"\| lm loss: ", proc.stdout))
    assert logged > 0 and _loss_events(board) == logged, (_loss_events(board), logged)


class _Recorder:
    def __init__(self):
        self.calls = []

    def flush(self):
        self.calls.append("flush")

    def finish(self, exit_code=None):
        self.calls.append(("finish", exit_code))


def test_the_writers_are_flushed_and_wandb_finished_with_the_exit_code(monkeypatch):
    """Negative control in the same test: without before_exit nothing reaches them."""
    from megatron.training import global_vars

    from megatron_async.megatron_lm.safety import exit_flush

    board, wandb = _Recorder(), _Recorder()
    monkeypatch.setattr(global_vars, "_GLOBAL_TENSORBOARD_WRITER", board)
    monkeypatch.setattr(global_vars, "_GLOBAL_WANDB_WRITER", wandb)
    assert board.calls == wandb.calls == []
    exit_flush.before_exit(3)
    assert board.calls == ["flush"] and wandb.calls == [("finish", 3)]


def test_an_unfinished_asynchronous_save_is_named(monkeypatch, capsys):
    from megatron.training import async_utils

    from megatron_async.megatron_lm.safety import exit_flush

    monkeypatch.setattr(async_utils, "is_empty_async_queue", lambda: False)
    exit_flush.before_exit(3)
    assert "asynchronous checkpoint save (--async-save) was still being written" in capsys.readouterr().err
    monkeypatch.setattr(async_utils, "is_empty_async_queue", lambda: True)
    exit_flush.before_exit(3)
    assert "asynchronous" not in capsys.readouterr().err

"""A tracked 2bw checkpoint always has its megatron_async.json (what says how to read its
stash), or the resume is refused.

- `torch_dist`: the marker is written when Megatron names its tracker file, after every
  rank saved and before the tracker is written (megatron_lm/adapter/hooks.py, get_checkpoint_tracker_filename).
  A job that dies right after Megatron's save of iteration 8 returned (tracker written,
  nothing of ours after it run) leaves iteration 8 with its marker, and the resume trains.
- A tracked checkpoint whose files hold a stash but whose marker was deleted (lost, or
  copied without it) is refused before training, naming the file and the previous
  complete checkpoint; the refusal's way out, --no-load-optim, trains (the negative
  control: the check refuses only that case).

The resumed run's first --metrics-json record has its seconds too, and one line ahead of
Megatron's first log line says its grad norm is the last stage's own.
"""

import json

from test_checkpoint_guard import TORCH_DIST
from tests.support.loop_runs import CPU, MODEL, TRAIN, logged_losses, run

from tests.support.warm_launch import warm_run

TIMEOUT_S = 240
SAVE = ["--save-interval", "4"]


def test_a_job_lost_right_after_megatrons_save_leaves_the_marker(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = warm_run("tests.support.step_end_entry",
                    ["--gpt", *CPU, *MODEL, *TRAIN, *TORCH_DIST, "--save", str(ckpt), *SAVE], 2, TIMEOUT_S,
                    env={"MEGATRON_ASYNC_TEST_EXIT_AFTER_SAVE": "8"})
    assert proc.returncode == 9, proc.stdout[-3000:]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "8"
    assert (ckpt / "iter_0000008" / "megatron_async.json").is_file()
    proc, metrics = run(tmp_path, "resumed", 2, TORCH_DIST + ["--load", str(ckpt), "--train-iters", "12",
                                                              "--override-opt_param-scheduler"])
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "holds no weight stash" not in proc.stdout and len(logged_losses(metrics)) == 4
    first = json.loads(metrics.read_text().splitlines()[0])  # timed from the start of Megatron's train
    assert first["iteration"] == 9 and isinstance(first["s_per_iter"], float) and first["s_per_iter"] > 0, first
    lines = proc.stdout.splitlines()
    notes = [i for i, line in enumerate(lines) if "the grad norm in Megatron's log line" in line]
    logged = [i for i, line in enumerate(lines) if " iteration        9/" in line]
    assert len(notes) == 1 and logged and notes[0] < logged[0], proc.stdout[-4000:]
    assert "is the last pipeline stage's own gradient norm" in lines[notes[0]], lines[notes[0]]


def test_a_tracked_checkpoint_without_its_marker_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc, _ = run(tmp_path, "first", 2, TORCH_DIST + ["--save", str(ckpt), *SAVE])
    assert proc.returncode == 0, proc.stdout[-4000:]
    (ckpt / "iter_0000008" / "megatron_async.json").unlink()
    longer = ["--train-iters", "12", "--override-opt_param-scheduler"]
    proc, _ = run(tmp_path, "refused", 2, TORCH_DIST + ["--load", str(ckpt)] + longer)
    assert proc.returncode == 2, proc.stdout[-4000:]
    line = next(line for line in proc.stdout.splitlines() if "megatron_async.json" in line and "error" in line)
    assert "iter_0000008" in line and "(--ckpt-step 4)" in line and "--no-load-optim" in line, line
    proc, _ = run(tmp_path, "fresh_versions", 2, TORCH_DIST + ["--load", str(ckpt), "--no-load-optim"] + longer)
    assert proc.returncode == 0, proc.stdout[-4000:]

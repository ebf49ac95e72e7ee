"""Room for a checkpoint in --save (megatron_lm/safety/save_space.py, full_disk.py).

- The size it expects bounds what a save really takes: a 2bw PP=2 run's checkpoint on
  disk (torch and torch_dist formats; the blocks of its folders and files and the
  tracker's) is at most the printed estimate, and not less than 80% of it.
- On a real file system too small for one checkpoint (a tmpfs), every rank refuses
  before training, naming the free space and the need; nothing is trained or saved.
  Negative control: the same run on a tmpfs with room trains and saves.
- A tmpfs with room for one checkpoint but not two: the second save fails on every rank
  with one line of ours naming ENOSPC and the folder, no traceback; the partial folder
  is set aside as `iter_N.torn` and the tracker names the complete one.
"""

import re

import pytest
from tests.support.loop_runs import run

PP2_2BW = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw", "--train-iters", "2",
           "--save-interval", "2"]
NEED = re.compile(r"one checkpoint needs about [\d.]+ (?:B|KiB|MiB|GiB) \((\d+) bytes")


def _disk_bytes(ckpt, iteration: int) -> int:
    """What one checkpoint takes on disk: the blocks of its folders and files, and the tracker's."""
    folder = ckpt / f"iter_{iteration:07d}"
    return sum(p.stat().st_blocks * 512 for p in [folder, *folder.rglob("*"), ckpt / "latest_checkpointed_iteration.txt"])


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_the_expected_size_bounds_what_a_save_takes(tmp_path, fmt):
    ckpt = tmp_path / "ckpt"
    proc, _ = run(tmp_path, fmt, 2, PP2_2BW + ["--ckpt-format", fmt, "--save", str(ckpt)])
    assert proc.returncode == 0, proc.stdout[-4000:]
    expected = int(NEED.search(proc.stdout).group(1))
    written = _disk_bytes(ckpt, 2)
    assert 0.8 * expected <= written <= expected, (written, expected)


def test_a_save_without_room_is_refused_before_training(tmp_path, tmpfs):
    small = tmpfs("fs_1m", "size=1m")
    proc, metrics = run(tmp_path, "small", 2, PP2_2BW + ["--save", str(small / "ckpt")])
    assert proc.returncode == 2, proc.stdout[-4000:]
    refusals = [line for line in proc.stdout.splitlines() if "free, but one checkpoint of this run needs" in line]
    assert {line.rsplit("(rank ", 1)[1] for line in refusals} == {"0)", "1)"}, proc.stdout[-4000:]
    assert not any(" 0.00 " in line or " 0.0 " in line for line in refusals), refusals  # sizes in a unit that shows them
    assert not metrics.exists() or "lm_loss" not in metrics.read_text()
    assert not any((small / "ckpt").glob("iter_*"))
    # negative control: with room, the same run trains and saves
    roomy = tmpfs("fs_64m", "size=64m")
    proc, metrics = run(tmp_path, "roomy", 2, PP2_2BW + ["--save", str(roomy / "ckpt")])
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert (roomy / "ckpt" / "iter_0000002").is_dir()


def test_sizes_are_written_in_a_unit_that_shows_them():
    from megatron_async.megatron_lm.safety.save_space import size_text

    assert [size_text(n) for n in (512, 3 * 2**10, int(3.4 * 2**20), int(12.5 * 2**30))] == [
        "512 B", "3.0 KiB", "3.4 MiB", "12.50 GiB"]


def test_a_disk_that_fills_during_a_save_is_one_line_and_the_partial_folder_set_aside(tmp_path, tmpfs):
    """6 MiB: the check before training passes (one checkpoint: about 4.2 MiB), the save at
    iteration 2 fits, the one at 4 does not."""
    from megatron_async.megatron_lm.safety.checkpoint_guard import complete_iterations, tracked_iteration

    ckpt = tmpfs("fs_6m", "size=6m") / "ckpt"
    proc, _ = run(tmp_path, "fills", 2, PP2_2BW + ["--train-iters", "4", "--save", str(ckpt)])
    assert proc.returncode == 2, proc.stdout[-4000:]
    lines = [line for line in proc.stdout.splitlines() if "megatron-async: error:" in line]
    assert {line.rsplit("(rank ", 1)[1] for line in lines} == {"0)", "1)"}, proc.stdout[-4000:]
    assert all(f"no space left on device while saving {ckpt / 'iter_0000004'}" in line
               and "the last complete checkpoint is iteration 2" in line for line in lines), lines
    assert "Traceback" not in proc.stdout, proc.stdout[-4000:]
    assert (ckpt / "iter_0000004.torn").is_dir() and not (ckpt / "iter_0000004").exists()
    assert tracked_iteration(str(ckpt)) == 2 and complete_iterations(str(ckpt)) == [2]

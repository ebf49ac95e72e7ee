"""Room for a checkpoint in --save, checked before training (megatron_lm/safety/save_space.py).

- The size it expects is the size a save really writes: a 2bw PP=2 run's checkpoint
  on disk (torch and torch_dist formats) is within [0.8, 1.25] of the printed estimate.
- On a real file system too small for one checkpoint (a tmpfs), every rank refuses
  before training, naming the free space and the need; nothing is trained or saved.
  Negative control: the same run on a tmpfs with room trains and saves.
"""

import re
import subprocess

import pytest
from test_megatron_loop import _run

PP2_2BW = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw", "--train-iters", "2",
           "--save-interval", "2"]
NEED = re.compile(r"one checkpoint needs about ([\d.]+) (B|KiB|MiB|GiB)")
UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def _disk_bytes(folder) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_the_expected_size_is_what_a_save_writes(tmp_path, fmt):
    ckpt = tmp_path / "ckpt"
    proc, _ = _run(tmp_path, fmt, 2, PP2_2BW + ["--ckpt-format", fmt, "--save", str(ckpt)])
    assert proc.returncode == 0, proc.stdout[-4000:]
    found = NEED.search(proc.stdout)
    expected = float(found.group(1)) * UNITS[found.group(2)]
    written = _disk_bytes(ckpt / "iter_0000002")
    assert 0.8 <= written / expected <= 1.25, (written, expected)


@pytest.fixture
def tmpfs(tmp_path):
    mounted = []

    def mount(size: str):
        where = tmp_path / f"fs_{size}"
        where.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {proc.stderr.strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_save_without_room_is_refused_before_training(tmp_path, tmpfs):
    small = tmpfs("1m")
    proc, metrics = _run(tmp_path, "small", 2, PP2_2BW + ["--save", str(small / "ckpt")])
    assert proc.returncode == 2, proc.stdout[-4000:]
    refusals = [line for line in proc.stdout.splitlines() if "free, but one checkpoint of this run needs" in line]
    assert {line.rsplit("(rank ", 1)[1] for line in refusals} == {"0)", "1)"}, proc.stdout[-4000:]
    assert not any(" 0.00 " in line or " 0.0 " in line for line in refusals), refusals  # sizes in a unit that shows them
    assert not metrics.exists() or "lm_loss" not in metrics.read_text()
    assert not any((small / "ckpt").glob("iter_*"))
    # negative control: with room, the same run trains and saves
    roomy = tmpfs("64m")
    proc, metrics = _run(tmp_path, "roomy", 2, PP2_2BW + ["--save", str(roomy / "ckpt")])
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert (roomy / "ckpt" / "iter_0000002").is_dir()


def test_sizes_are_written_in_a_unit_that_shows_them():
    from megatron_async.megatron_lm.safety.save_space import size_text

    assert [size_text(n) for n in (512, 3 * 2**10, int(3.4 * 2**20), int(12.5 * 2**30))] == [
        "512 B", "3.0 KiB", "3.4 MiB", "12.50 GiB"]

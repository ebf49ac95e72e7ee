"""The image, built and run here: docker/image.sh builds the project's Dockerfile with podman
(runc) on the stand-in base (docker/standin: Debian's Python and the pinned torch), changed
only by build arguments; the CI smoke runs inside it; and the image runs the ranks of
examples/slurm/pretrain_2bw.sbatch on the local two-node Slurm (PODMAN_IMAGE: podman on
each node, examples/slurm/podman_rank.sh).

With MEGATRON_LM_MIRROR set (a local git mirror of NVIDIA/Megatron-LM holding the pin), the
image carries the patched Megatron-LM checkout and the smoke also trains through its
pretrain_gpt.py. Without podman or debootstrap this fails, saying why (.ci/run installs them).
Run by `make test-cluster`.
"""

import os
import re
import shutil
import subprocess
import time

import pytest
from slurm_jobs import END, REPO, _losses, _state, _submit, _wait, preempt_and_finish

IMAGE = "localhost/megatron-async:test"


@pytest.fixture(scope="module")
def image():
    missing = [tool for tool in ("podman", "runc", "debootstrap") if shutil.which(tool) is None]
    assert not missing, f"the image tests need {missing} (apt-get install podman runc debootstrap)"
    start = time.monotonic()
    built = subprocess.run(["bash", str(REPO / "docker/image.sh"), "build"], env=dict(os.environ, IMAGE=IMAGE),
                           capture_output=True, text=True, timeout=1800)
    print(f"image built in {time.monotonic() - start:.0f} s")
    assert built.returncode == 0, f"the image did not build:\n{built.stdout[-6000:]}\n{built.stderr[-6000:]}"
    return built.stdout + built.stderr


def test_the_image_keeps_the_bases_torch_and_installs_the_hooks(image):
    kept = re.search(r"install\.sh: keeping (.*)", image)
    assert kept and "torch==" in kept.group(1), image[-4000:]
    assert "install.sh: plugin hooks in place" in image, image[-4000:]
    if os.environ.get("MEGATRON_LM_MIRROR"):
        assert "megatron-lm" in image and "already patched" not in image, image[-4000:]


def test_the_ci_smoke_trains_2bw_inside_the_image(image):
    start = time.monotonic()
    smoke = subprocess.run(["bash", str(REPO / "docker/image.sh"), "smoke"], env=dict(os.environ, IMAGE=IMAGE),
                           capture_output=True, text=True, timeout=1200)
    print(f"smoke in {time.monotonic() - start:.0f} s")
    out = smoke.stdout + smoke.stderr
    assert smoke.returncode == 0, out[-6000:]
    assert re.search(r"image: Python 3\.1[2-9]\S* torch \S+ cuda False", out), out[-4000:]
    runs = 2 if os.environ.get("MEGATRON_LM_MIRROR") else 1
    assert len(re.findall(r"^demo learned: final validation loss", out, re.M)) == runs, out[-4000:]
    if runs == 2:  # Megatron-LM's pretrain_gpt.py and the plugin's GPT entry: the same model, data and steps
        ours, theirs = out.split("== the same run through the patched Megatron-LM pretrain_gpt.py")
        assert _losses_logged(ours) == _losses_logged(theirs), out[-4000:]


def _losses_logged(out: str) -> list:
    return re.findall(r"^iteration +(\d+)/.*lm loss: (\S+)", out, re.M)


@pytest.fixture(scope="module")
def in_image(image, slurm, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("image_jobs") / "uninterrupted"
    job = _submit(slurm, run_dir, PODMAN_IMAGE=IMAGE, LAUNCHER="launch")  # launch: the CPU flags
    _wait(lambda: _state(slurm, job) in ("COMPLETED", "FAILED", "CANCELLED", "GONE"), "end of the job")
    return job, run_dir


def _containers_left() -> str:
    return subprocess.run(["podman", "ps", "-q", "--filter", f"ancestor={IMAGE}"], capture_output=True,
                          text=True).stdout.strip()


def test_the_image_runs_the_ranks_of_the_slurm_job(slurm, in_image):
    """sbatch with PODMAN_IMAGE: each rank is `podman run` of the image on its node, the
    rendezvous from the job's node list, and no container is left after the job."""
    job, run_dir = in_image
    log = (run_dir / f"job-{job}.out").read_text()
    assert _state(slurm, job) == "COMPLETED", log[-4000:]
    assert set(re.findall(rf"^rank (\d) on (\w+): podman run {re.escape(IMAGE)}", log, re.M)) == {
        ("0", "node1"), ("1", "node2")}, log[-4000:]
    assert dict(re.findall(r"^rank (\d) of 2 on (\w+)", log, re.M)) == {"0": "node1", "1": "node2"}, log[-4000:]
    losses = _losses(run_dir)
    assert sorted(losses) == list(range(1, END + 1)) and losses[END] < losses[1]
    assert not _containers_left()


def test_slurms_signal_reaches_the_ranks_in_the_image(slurm, in_image, tmp_path):
    """`scancel --signal=TERM` reaches each rank through podman's signal proxy: the ranks stop
    after one agreed iteration and save, the job requeues itself, and its restart resumes
    and matches the uninterrupted job in the image bit for bit."""
    run_dir = tmp_path / "preempted"
    job = _submit(slurm, run_dir, PODMAN_IMAGE=IMAGE, LAUNCHER="launch")
    _, stop = preempt_and_finish(slurm, run_dir, job)
    _, reference = in_image
    losses = _losses(run_dir)
    assert sorted(losses) == list(range(1, END + 1)) and stop < END
    assert losses == _losses(reference)
    assert not _containers_left()

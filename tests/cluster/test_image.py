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
from slurm_jobs import END, REPO, _losses, _state, _submit, _wait

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


def test_the_image_runs_the_ranks_of_the_slurm_job(image, slurm, tmp_path):
    """sbatch with PODMAN_IMAGE: each rank is `podman run` of the image on its node, the
    rendezvous from the job's node list, and no container is left after the job."""
    run_dir = tmp_path / "in_image"
    job = _submit(slurm, run_dir, PODMAN_IMAGE=IMAGE, PRETRAIN="--gpt", LAUNCHER="launch")
    _wait(lambda: _state(slurm, job) in ("COMPLETED", "FAILED", "CANCELLED", "GONE"), "end of the job")
    log = (run_dir / f"job-{job}.out").read_text()
    assert _state(slurm, job) == "COMPLETED", log[-4000:]
    assert set(re.findall(rf"^rank (\d) on (\w+): podman run {re.escape(IMAGE)}", log, re.M)) == {
        ("0", "node1"), ("1", "node2")}, log[-4000:]
    assert dict(re.findall(r"^rank (\d) of 2 on (\w+)", log, re.M)) == {"0": "node1", "1": "node2"}, log[-4000:]
    losses = _losses(run_dir)
    assert sorted(losses) == list(range(1, END + 1)) and losses[END] < losses[1]
    left = subprocess.run(["podman", "ps", "-q", "--filter", f"ancestor={IMAGE}"], capture_output=True, text=True)
    assert not left.stdout.strip(), f"containers left after the job: {left.stdout}"


"""The local two-node Slurm, started once for every cluster test and stopped after them."""

import os
import shutil
import subprocess

import pytest
from slurm_jobs import CLUSTER, CLUSTER_ENV


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    base = tmp_path_factory.mktemp("slurm")
    env = dict(os.environ, BASE=str(base))
    CLUSTER_ENV.update(env)
    munge_before = subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode == 0
    start = subprocess.run(["bash", str(CLUSTER), "start"], env=env, capture_output=True, text=True, timeout=180)
    try:
        assert start.returncode == 0, f"the local Slurm did not start:\n{start.stdout}\n{start.stderr}"
        yield dict(os.environ, SLURM_CONF=str(base / "slurm.conf"))
    finally:
        subprocess.run(["bash", str(CLUSTER), "stop"], env=env, capture_output=True, text=True, timeout=120)
        left = subprocess.run(["pgrep", "-af", f"{base}/slurm.conf|slurmstepd"], capture_output=True, text=True).stdout
        if not munge_before:
            left += subprocess.run(["pgrep", "-ax", "munged"], capture_output=True, text=True).stdout
        left = "\n".join(line for line in left.splitlines() if "<defunct>" not in line)  # exited, not yet reaped
        netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        if shutil.which("podman"):  # a job's ranks in containers (tests/cluster/test_image.py)
            left += subprocess.run(["podman", "ps", "--format", "{{.Names}} {{.Image}}"], capture_output=True,
                                   text=True).stdout
        assert not left.strip() and "mas-node" not in netns, f"left running: {left} {netns}"



"""examples/slurm/pretrain_2bw.sbatch under a real two-node Slurm on this machine.

examples/slurm/local_cluster.sh starts munge, slurmctld and two slurmds, each node a
network namespace with its own address and host name, and stops them all afterwards.
The sbatch runs unchanged, with only its resources overridden on the command line
(2 nodes x 1 task, no GPUs), VENV, and the small 2bw PP=2 config
examples/slurm/smoke_flags.sh:

- the two stages run on the two nodes (each rank's line in the job log names its
  node), with the rendezvous from the job's node list, and the job completes;
- preempted: `scancel --signal=TERM` mid-run, every rank stops after one agreed
  iteration and saves, the job requeues itself (`scontrol requeue`), its restart
  (SLURM_RESTART_COUNT 1) resumes from that checkpoint and finishes, and its
  per-iteration losses equal the uninterrupted job's bit for bit (dropout 0.1).

Where Slurm cannot start here this fails, saying why; it never passes silently.
Run by `make test-cluster` (.ci/run installs Debian's slurm-wlm and munge first).
"""

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "examples" / "slurm" / "local_cluster.sh"
RESOURCES = ["--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=0", "--cpus-per-task=1"]
END = 40  # --exit-interval of both jobs (the same --train-iters, so the same learning-rate schedule); the
# signal comes after iteration 3, long before it


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    base = tmp_path_factory.mktemp("slurm")
    env = dict(os.environ, BASE=str(base))
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
        assert not left.strip() and "mas-node" not in netns, f"left running: {left} {netns}"


def _submit(slurm, run_dir: Path) -> int:
    env = dict(slurm, CONFIG=str(REPO / "examples/slurm/smoke_flags.sh"), RUN_DIR=str(run_dir),
               VENV=str(Path(os.environ.get("VIRTUAL_ENV", REPO / ".venv"))), PRETRAIN="--gpt", REPO=str(REPO),
               EXIT_INTERVAL=str(END))
    run_dir.mkdir(parents=True)
    out = subprocess.run(["sbatch", "--parsable", *RESOURCES, f"--output={run_dir}/job-%j.out",
                          str(REPO / "examples/slurm/pretrain_2bw.sbatch")], env=env, cwd=run_dir,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip().split(";")[0])


def _job(slurm, job: int) -> str:
    return subprocess.run(["scontrol", "show", "job", str(job)], env=slurm, capture_output=True, text=True).stdout


def _state(slurm, job: int) -> str:
    match = re.search(r"JobState=(\w+)", _job(slurm, job))
    return match.group(1) if match else "GONE"


def _wait(predicate, what, timeout_s=420):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(1)


def _losses(run_dir: Path) -> dict:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return {}
    return {r["iteration"]: r["lm_loss"] for r in map(json.loads, path.read_text().splitlines()) if "lm_loss" in r}


@pytest.fixture(scope="module")
def uninterrupted(slurm, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("jobs") / "uninterrupted"
    job = _submit(slurm, run_dir)
    _wait(lambda: _state(slurm, job) in ("COMPLETED", "FAILED", "CANCELLED", "GONE"), "end of the job")
    return job, run_dir


def test_the_sbatch_trains_2bw_across_two_nodes(slurm, uninterrupted):
    job, run_dir = uninterrupted
    log = (run_dir / f"job-{job}.out").read_text()
    assert _state(slurm, job) == "COMPLETED", log[-4000:]
    nodes = dict(re.findall(r"^rank (\d) of 2 on (\w+)", log, re.M))
    assert nodes == {"0": "node1", "1": "node2"}, log[-4000:]
    losses = _losses(run_dir)
    assert sorted(losses) == list(range(1, END + 1))
    assert losses[END] < losses[1]


def test_a_preempted_job_saves_requeues_and_resumes_bit_for_bit(slurm, uninterrupted, tmp_path):
    run_dir = tmp_path / "preempted"
    job = _submit(slurm, run_dir)
    _wait(lambda: len(_losses(run_dir)) >= 3, "third iteration")
    subprocess.run(["scancel", "--signal=TERM", str(job)], env=slurm, check=True)
    _wait(lambda: "Restarts=1" in _job(slurm, job), "requeue")

    # Slurm starts a requeued job once its credentials expired (cred_expire, 10 s in local_cluster.sh)
    _wait(lambda: _state(slurm, job) in ("COMPLETED", "FAILED", "CANCELLED", "GONE")
          and "restart 1" in (run_dir / f"job-{job}.out").read_text(), "end of the restarted job")
    log = (run_dir / f"job-{job}.out").read_text()
    assert _state(slurm, job) == "COMPLETED", log[-4000:]
    stop = int(re.search(r"stopping after iteration (\d+), agreed by every rank: a signal", log).group(1))
    assert f"stopped early: {{\"iteration\": {stop}" in log and "requeueing" in log, log[-4000:]
    assert re.search(rf"loaded checkpoint .* at iteration\s+{stop}\b", log), log[-4000:]
    assert "rank 0 of 2 on node1 (job %d, restart 1)" % job in log
    _, reference = uninterrupted
    losses, whole = _losses(run_dir), _losses(reference)
    assert sorted(losses) == list(range(1, END + 1)) and stop < END
    assert losses == whole  # bit for bit, across the stop and the restart

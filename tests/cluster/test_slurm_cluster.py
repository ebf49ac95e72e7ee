"""examples/slurm/pretrain_2bw.sbatch under a real two-node Slurm on this machine.

examples/slurm/local_cluster.sh starts munge, slurmctld and two slurmds, each node a
network namespace with its own address and host name, and stops them all afterwards.
The sbatch runs unchanged, with only its resources overridden on the command line
(2 nodes x 1 task, no GPUs), VENV, and the small 2bw PP=2 config
examples/slurm/smoke_flags.sh:

- the two stages run on the two nodes (each rank's line in the job log names its
  node), with the rendezvous from the job's node list, and the job completes;
- a node lost mid-run (its slurmd and ranks killed with SIGKILL): the job ends with the
  surviving rank naming the lost peer and no process of the job left on the other
  node; resubmitted once the node is back, it resumes from the last complete
  checkpoint and its losses equal the uninterrupted job's bit for bit;
- preempted: `scancel --signal=TERM` mid-run, every rank stops after one agreed
  iteration and saves, the job requeues itself (`scontrol requeue`), its restart
  (SLURM_RESTART_COUNT 1) resumes from that checkpoint and finishes, and its
  per-iteration losses equal the uninterrupted job's bit for bit (dropout 0.1).

Where Slurm cannot start here this fails, saying why; it never passes silently.
Run by `make test-cluster` (.ci/run installs Debian's slurm-wlm and munge first).
"""

import re
import subprocess

import pytest
from slurm_jobs import CLUSTER, CLUSTER_ENV, END, _losses, _state, _submit, _wait, preempt_and_finish

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
    log, stop = preempt_and_finish(slurm, run_dir, job)
    assert f"stopped early: {{\"iteration\": {stop}" in log and "requeueing" in log, log[-4000:]
    assert "rank 0 of 2 on node1 (job %d, restart 1)" % job in log
    _, reference = uninterrupted
    losses, whole = _losses(run_dir), _losses(reference)
    assert sorted(losses) == list(range(1, END + 1)) and stop < END
    assert losses == whole  # bit for bit, across the stop and the restart


def test_a_lost_node_ends_the_job_and_a_resubmission_resumes(slurm, uninterrupted, tmp_path):
    run_dir = tmp_path / "lost"
    # --no-requeue: this test resubmits by hand (a job Slurm requeues itself keeps its id, and the
    # returning node may still be told to end that id's old steps)
    job = _submit(slurm, run_dir, ["--no-requeue"], SAVE_INTERVAL="5")
    _wait(lambda: (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").exists()
          and len(_losses(run_dir)) >= 7, "a checkpoint and two more iterations")
    subprocess.run(["bash", str(CLUSTER), "kill-node", "node2"], env=CLUSTER_ENV, check=True)
    _wait(lambda: _state(slurm, job) not in ("RUNNING", "COMPLETING", "CONFIGURING", "PENDING"), "end of the job", 180)
    log = (run_dir / f"job-{job}.out").read_text()
    assert re.search(r"megatron-async: rank 0: lost a peer rank", log), log[-4000:]
    assert "Node failure on node2" in log or "node2" in log, log[-4000:]
    ranks_left = subprocess.run(["pgrep", "-af", f"megatron_async.launch.*{run_dir}"], capture_output=True,
                                text=True).stdout
    assert not ranks_left.strip(), ranks_left
    saved = int((run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text())
    assert saved % 5 == 0 and saved < END
    subprocess.run(["bash", str(CLUSTER), "start-node", "node2"], env=CLUSTER_ENV, check=True)
    _wait(lambda: subprocess.run(["sinfo", "-h", "-n", "node2", "-o", "%T"], env=slurm, capture_output=True,
                                 text=True).stdout.strip() == "idle", "node2 back", 120)
    resumed = _submit(slurm, run_dir, SAVE_INTERVAL="5")
    _wait(lambda: _state(slurm, resumed) in ("COMPLETED", "FAILED", "CANCELLED", "GONE"), "end of the resubmitted job")
    log = (run_dir / f"job-{resumed}.out").read_text()
    assert re.search(rf"loaded checkpoint .* at iteration\s+{saved}\b", log), log[-4000:]
    _, reference = uninterrupted
    losses = _losses(run_dir)
    assert sorted(losses) == list(range(1, END + 1))
    assert {i: _losses(reference)[i] for i in range(saved + 1, END + 1)} == {
        i: losses[i] for i in range(saved + 1, END + 1)}  # bit for bit after the resume

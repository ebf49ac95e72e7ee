"""Submitting examples/slurm/pretrain_2bw.sbatch to the local two-node Slurm
(examples/slurm/local_cluster.sh, started by conftest.py) and reading its jobs back."""

import json
import os
import re
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "examples" / "slurm" / "local_cluster.sh"
CLUSTER_ENV: dict = {}  # the environment local_cluster.sh started with (its BASE), for kill-node/start-node
RESOURCES = ["--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=0", "--cpus-per-task=1"]
END = 40  # --exit-interval of both jobs (the same --train-iters, so the same learning-rate schedule); the
# signal comes after iteration 3, long before it


def _submit(slurm, run_dir: Path, options=(), **extra) -> int:
    env = dict(slurm, CONFIG=str(REPO / "examples/slurm/smoke_flags.sh"), RUN_DIR=str(run_dir),
               VENV=str(Path(os.environ.get("VIRTUAL_ENV", REPO / ".venv"))), PRETRAIN="--gpt", REPO=str(REPO),
               EXIT_INTERVAL=str(END), **extra)
    run_dir.mkdir(parents=True, exist_ok=True)
    out = subprocess.run(["sbatch", "--parsable", *RESOURCES, *options, f"--output={run_dir}/job-%j.out",
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




def preempt_and_finish(slurm, run_dir: Path, job: int) -> tuple[str, int]:
    """`scancel --signal=TERM` after the job's third iteration; wait for its requeue and for
    its restart to end. Returns (the job log, the iteration every rank agreed to stop after)."""
    _wait(lambda: len(_losses(run_dir)) >= 3, "third iteration")
    subprocess.run(["scancel", "--signal=TERM", str(job)], env=slurm, check=True)
    _wait(lambda: "Restarts=1" in _job(slurm, job), "requeue")
    # Slurm starts a requeued job once its credentials expired (cred_expire, 10 s in local_cluster.sh)
    _wait(lambda: _state(slurm, job) in ("COMPLETED", "FAILED", "CANCELLED", "GONE")
          and "restart 1" in (run_dir / f"job-{job}.out").read_text(), "end of the restarted job")
    log = (run_dir / f"job-{job}.out").read_text()
    assert _state(slurm, job) == "COMPLETED", log[-4000:]
    stop = int(re.search(r"stopping after iteration (\d+), agreed by every rank: a signal", log).group(1))
    assert re.search(rf"loaded checkpoint .* at iteration\s+{stop}\b", log), log[-4000:]
    return log, stop

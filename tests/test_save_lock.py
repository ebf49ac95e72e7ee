"""One writer per --save (megatron_lm/safety/save_lock.py), with real jobs of two gloo ranks.

- A second job started on the --save of a live job (resuming from it, as a requeue
  beside its own zombie does, so the guard against newer checkpoints passes) is refused before training, on
  every rank, naming the first job (host, pid, start time), and leaves the first
  job's checkpoints alone; the first job keeps training and saving.
- After the first job is killed with SIGKILL, a requeue of it (the same --save and
  --load) takes the lock and trains: the lock belongs to a live process.
- The other order: a job whose lock file was removed and taken by another job while
  it ran stops before its next save, naming the job that took it.
Negative control: two jobs on two different --save directories both train.

The jobs are warm ranks in the background (tests/support/warm_launch.WarmJob): what takes
the lock is the worker, not its launcher, so torchrun adds nothing here but its
imports; a killed torchrun and its workers are tests/test_long_runs.py's.
"""

import json
import os
import time

from test_long_runs import MEGATRON_LOOP

from megatron_async.megatron_lm.safety.save_lock import LOCK_NAME
from tests.support.warm_launch import WarmJob


def _job(tmp_path, name, save, iters, extra=()):
    args = [a for a in MEGATRON_LOOP]
    args[args.index("--train-iters") + 1] = str(iters)
    args += ["--save", str(save), "--save-interval", "2", "--metrics-json", str(tmp_path / f"{name}.jsonl"), *extra]
    # No shared mock-data index: jobs here start side by side. peers_exit_s: each rank of a
    # refused job refuses on its own, and the test reads every rank's line.
    return WarmJob("megatron_async.launch", args, 2, log_path=tmp_path / f"{name}.log", mock_data_cache=False,
                   peers_exit_s=30)


def _wait_for(predicate, job, what, timeout_s=180):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert job.running(), f"the job ended before {what}:\n{job.log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.1)


def _finish(job, timeout_s=180):
    proc = job.wait(timeout_s)
    return proc.returncode, proc.stdout


def _holder(save):
    """The pid in the lock file, or None while there is none (or it is being written)."""
    try:
        return json.loads((save / LOCK_NAME).read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return None


def _latest(save):
    return (save / "latest_checkpointed_iteration.txt").read_text().strip()


def test_a_second_job_on_a_live_jobs_save_is_refused_and_a_requeue_after_kill_takes_it(tmp_path):
    save = tmp_path / "ckpt"
    first = _job(tmp_path, "first", save, 100000)
    try:
        _wait_for(lambda: (save / "latest_checkpointed_iteration.txt").exists(), first, "a first checkpoint")
        owner = (save / LOCK_NAME).read_text()
        # a requeue beside its own zombie: it resumes from --save, so only the lock stops it
        code, out = _finish(_job(tmp_path, "second", save, 100000, ["--load", str(save)]))
        assert code != 0, out[-4000:]
        refusals = [line for line in out.splitlines() if "is being written by another live job" in line]
        assert {line.rsplit("(rank ", 1)[1] for line in refusals} == {"0)", "1)"}, out[-4000:]
        holder = json.loads(owner)["pid"]
        assert holder in first.pids and f"pid {os.getpid()}" not in refusals[0]  # a worker holds it, not the launcher
        assert f"pid {holder}" in refusals[0] and "started" in refusals[0]
        assert "lm_loss" not in (tmp_path / "second.jsonl").read_text() if (tmp_path / "second.jsonl").exists() else True
        assert first.running()  # the first job trains on
        first.kill()  # the whole job, as a node failure would
        assert (save / LOCK_NAME).exists()  # left behind, and harmless: the lock was the process's
        code, out = _finish(_job(tmp_path, "requeue", save, int(_latest(save)) + 2, ["--load", str(save),
                                                                                    "--override-opt_param-scheduler"]))
        assert code == 0, out[-4000:]
        assert "lm_loss" in (tmp_path / "requeue.jsonl").read_text()
    finally:
        first.kill()


def test_a_job_whose_save_was_taken_over_stops_before_its_next_save(tmp_path):
    save = tmp_path / "ckpt"
    first = _job(tmp_path, "first", save, 100000)
    try:
        _wait_for(lambda: (save / "latest_checkpointed_iteration.txt").exists(), first, "a first checkpoint")
        (save / LOCK_NAME).unlink()  # e.g. a clean-up script; the first job's lock now holds nothing
        other = _job(tmp_path, "other", save, 100000, ["--load", str(save)])
        try:
            _wait_for(lambda: _holder(save) is not None and _holder(save) not in first.pids
                      and (tmp_path / "other.jsonl").exists(), other, "the other job's lock")
            code, out = _finish(first, 120)
            assert code != 0, out[-4000:]
            assert "was taken over while this job ran" in out and "stops before saving iteration" in out, out[-4000:]
        finally:
            other.kill()
    finally:
        first.kill()


def test_jobs_on_different_save_directories_both_train(tmp_path):
    """The negative control: the lock is per directory."""
    jobs = [_job(tmp_path, name, tmp_path / name, 4) for name in ("a", "b")]
    for job in jobs:
        code, out = _finish(job)
        assert code == 0, out[-4000:]

"""One writer per --save (megatron_lm/save_lock.py), with real torchrun jobs.

- A second job started on the --save of a live job (resuming from it, as a requeue
  beside its own zombie does, so the guard against newer checkpoints passes) is refused before training, on
  every rank, naming the first job (host, pid, start time), and leaves the first
  job's checkpoints alone; the first job keeps training and saving.
- After the first job is killed with SIGKILL, a requeue of it (the same --save and
  --load) takes the lock and trains: the lock belongs to a live process.
- The other order: a job whose lock file was removed and taken by another job while
  it ran stops before its next save, naming the job that took it.
Negative control: two jobs on two different --save directories both train.
"""

import os
import signal
import subprocess
import sys
import time

import pytest
from test_long_runs import MEGATRON_LOOP

from megatron_async.megatron_lm.save_lock import LOCK_NAME
from megatron_async.testing.launch import finish_job


def _job(tmp_path, name, save, iters, extra=()):
    log = open(tmp_path / f"{name}.log", "w")
    args = [a for a in MEGATRON_LOOP]
    args[args.index("--train-iters") + 1] = str(iters)
    args += ["--save", str(save), "--save-interval", "2", "--metrics-json", str(tmp_path / f"{name}.jsonl"), *extra]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "megatron_async.launch", *args]
    proc = subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    proc.log = tmp_path / f"{name}.log"
    return proc


def _wait_for(predicate, proc, what, timeout_s=180):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert proc.poll() is None, f"the job ended before {what}:\n{proc.log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.3)


def _finish(proc, timeout_s=180):
    return finish_job(proc, proc.log, timeout_s)


def _latest(save):
    return (save / "latest_checkpointed_iteration.txt").read_text().strip()


def _kill(proc):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


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
        assert f"pid {first.pid}" not in refusals[0]  # the worker holds it, named by its own pid
        assert str(__import__("json").loads(owner)["pid"]) in refusals[0] and "started" in refusals[0]
        assert "lm_loss" not in (tmp_path / "second.jsonl").read_text() if (tmp_path / "second.jsonl").exists() else True
        assert first.poll() is None  # the first job trains on
        os.killpg(first.pid, signal.SIGKILL)  # the whole job, as a node failure would
        first.wait()
        time.sleep(1)
        code, out = _finish(_job(tmp_path, "requeue", save, int(_latest(save)) + 2, ["--load", str(save),
                                                                                    "--override-opt_param-scheduler"]))
        assert code == 0, out[-4000:]
        assert "lm_loss" in (tmp_path / "requeue.jsonl").read_text()
    finally:
        _kill(first)


def test_a_job_whose_save_was_taken_over_stops_before_its_next_save(tmp_path):
    save = tmp_path / "ckpt"
    first = _job(tmp_path, "first", save, 100000)
    try:
        _wait_for(lambda: (save / "latest_checkpointed_iteration.txt").exists(), first, "a first checkpoint")
        (save / LOCK_NAME).unlink()  # e.g. a clean-up script; the first job's lock now holds nothing
        other = _job(tmp_path, "other", save, 100000, ["--load", str(save)])
        try:
            _wait_for(lambda: "job" in ((save / LOCK_NAME).read_text() if (save / LOCK_NAME).exists() else "")
                      and str(first.pid) not in (save / LOCK_NAME).read_text()
                      and (tmp_path / "other.jsonl").exists(), other, "the other job's lock")
            code, out = _finish(first, 120)
            assert code != 0, out[-4000:]
            assert "was taken over while this job ran" in out and "stops before saving iteration" in out, out[-4000:]
        finally:
            _kill(other)
    finally:
        _kill(first)


def test_jobs_on_different_save_directories_both_train(tmp_path):
    """The negative control: the lock is per directory."""
    jobs = [_job(tmp_path, name, tmp_path / name, 4) for name in ("a", "b")]
    for job in jobs:
        code, out = _finish(job)
        assert code == 0, out[-4000:]

"""The --save lock (megatron_lm/safety/save_lock.py) on the file systems clusters use, emulated here:

- a file system that refuses flock (Lustre `noflock` answers ENOSYS) is refused with our
  line naming the error and the way out (the negative control: a real flock takes it);
- a process forked from the holder does not keep the lock once the holder is gone
  (control: a plain flock handed to a forked child does);
- a requeue of the same Slurm job waits, bounded and saying so, for the lock its earlier
  run still holds on another host, and takes it once freed (control: another Slurm job
  is refused at once);
- the check before each save is agreed by every rank: one rank that reads another job in
  the lock file stops both (control: both read this job and go on);
- a node-local lock (this node gets it, another host's holder is alive) is refused while
  the holder's record is fresh, and taken once it is stale.
"""

import errno
import json
import os
import subprocess
import sys
import textwrap
import time

from megatron_async.megatron_lm.safety import save_lock
from tests.support.multiprocess import run_distributed


def test_a_file_system_without_flock_is_refused_naming_it(tmp_path, monkeypatch):
    import fcntl

    assert save_lock.take(str(tmp_path / "real")) is None
    save_lock._HELD.clear()

    def no_flock(fd, op):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    problem = save_lock.take(str(tmp_path / "lustre"))
    assert problem and "refuses flock (ENOSYS: Function not implemented)" in problem and "-o flock" in problem


HOLDER = textwrap.dedent("""
    import fcntl, os, sys, time
    from megatron_async.megatron_lm.safety import save_lock
    save, how = sys.argv[1], sys.argv[2]
    if how == "take":
        assert save_lock.take(save) is None
    else:  # a plain flock, without the plugin's fork handler
        fd = os.open(os.path.join(save, save_lock.LOCK_NAME), os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)
    if os.fork() == 0:  # lets go of the test's pipes, keeps everything else
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 1)
        os.dup2(null, 2)
        time.sleep(10)
        os._exit(0)
    print("held", flush=True)
    os._exit(0)
""")

TAKER = textwrap.dedent("""
    import sys
    from megatron_async.megatron_lm.safety import save_lock
    print(save_lock.take(sys.argv[1]) or "taken", flush=True)
""")


def _python(code, *args, env=None):
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def test_a_forked_child_does_not_keep_the_holders_lock(tmp_path):
    for how, freed in (("take", True), ("plain flock", False)):
        save = tmp_path / how.replace(" ", "_")
        save.mkdir()
        held = _python(HOLDER, save, how)
        assert "held" in held.stdout, held.stderr[-2000:]
        taker = _python(TAKER, save)  # the holder has exited; its forked child sleeps on
        assert ("taken" in taker.stdout) is freed, (how, taker.stdout, taker.stderr[-2000:])


SLOW_HOLDER = textwrap.dedent("""
    import fcntl, json, os, sys, time
    save = sys.argv[1]
    fd = os.open(os.path.join(save, ".megatron_async_writer"), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.pwrite(fd, json.dumps({"job": "run-1 (Slurm job 77)", "host": "node-that-died", "pid": 1,
                              "started": "then"}).encode(), 0)
    past = time.time() - 100  # a dead node's record: untouched since it died
    os.utime(os.path.join(save, ".megatron_async_writer"), (past, past))
    print("held", flush=True)
    sys.stdin.readline()  # the lease expires when the test says so
""")


def test_a_requeue_of_the_same_slurm_job_waits_for_its_earlier_runs_lock(tmp_path):
    for slurm in ("77", "78"):
        save = tmp_path / f"job{slurm}"
        save.mkdir()
        holder = subprocess.Popen([sys.executable, "-c", SLOW_HOLDER, str(save)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "held"
        taker = subprocess.Popen([sys.executable, "-c", TAKER, str(save)], stdout=subprocess.PIPE, text=True,
                                 env={**os.environ, "SLURM_JOB_ID": slurm, save_lock.WAIT_ENV: "60"})
        try:
            first = taker.stdout.readline()  # waiting, or refused at once while the lock is still held
            holder.communicate("\n", timeout=30)
            rest = taker.communicate(timeout=60)[0]
        finally:
            for proc in (holder, taker):
                if proc.poll() is None:
                    proc.kill()
        if slurm == "77":
            assert "an earlier run of this Slurm job on host node-that-died" in first, first
            assert rest.strip() == "taken", rest
        else:
            assert "another live job" in first, first


def _agreement_entry(rank, world_size, save, other_on_rank1):
    from megatron_async.megatron_lm.safety import save_lock as lock

    lock.take_on_every_rank(save)
    if other_on_rank1 and rank == 1:
        lock.job_id = lambda: "another job"
    try:
        lock.check_before_save(save, 8)
    except lock.SaveLockError as err:
        return str(err)
    return None


def test_the_check_before_a_save_is_agreed_by_every_rank(tmp_path):
    problems = run_distributed(_agreement_entry, 2, str(tmp_path / "a"), True, timeout_s=60)
    assert all(p and "stops before saving iteration 8" in p for p in problems), problems
    assert run_distributed(_agreement_entry, 2, str(tmp_path / "b"), False, timeout_s=60) == [None, None]


def test_a_node_local_lock_is_refused_when_the_holders_record_is_alive(tmp_path, monkeypatch):
    """Emulated: this node gets the lock (flock succeeds) while the record names a job on
    another host. Touched just now, it is refused; gone stale, it is taken."""
    import fcntl

    monkeypatch.setattr(fcntl, "flock", lambda fd, op: None)
    for age, taken in ((0.0, False), (save_lock.STALE_S + 5, True)):
        save = tmp_path / f"age{int(age)}"
        save.mkdir()
        record = save / save_lock.LOCK_NAME
        record.write_text(json.dumps({"job": "run-9", "host": "other-node", "pid": 1, "started": "then"}))
        os.utime(record, (time.time() - age, time.time() - age))
        problem = save_lock.take(str(save))
        save_lock._HELD.clear()
        assert (problem is None) is taken, (age, problem)
        if not taken:
            assert "node-local" in problem and "other-node" in problem, problem

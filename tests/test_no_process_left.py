"""`make test` leaves no process behind, and says so when one is left.

- tests/support/no_process_left.py, which runs each pytest run of `make test`, fails
  naming a process the command left running and ends it; it passes the command's own
  exit status through, and never counts a process that the command did not start.
- The session's end (tests/conftest.py) ends the forkserver its ranks forked from: a
  pytest session whose forkserver is slow to exit (as the real one, which unwinds torch
  and Megatron-Core) leaves nothing. Negative control: the same session without the
  conftest leaves its forkserver, and the check fails naming it.
"""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHECK = [sys.executable, str(REPO / "tests" / "support" / "no_process_left.py")]


def _check(command, cwd=REPO, env=None):
    return subprocess.run(CHECK + command, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_a_process_left_running_is_named_ended_and_fails_the_check(tmp_path):
    # the leftover writes nowhere: run() then returns when the check does, not when the sleep ends
    out = _check(["sh", "-c", "sleep 97 > /dev/null 2>&1 & echo $! > leftover.pid"], cwd=tmp_path)
    assert out.returncode == 1, out.stderr
    assert "1 process(es) started by" in out.stderr and "sleep 97" in out.stderr
    pid = int((tmp_path / "leftover.pid").read_text())
    assert f"pid {pid} " in out.stderr
    assert not _running(pid)


def _running(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_a_clean_command_keeps_its_exit_status_and_other_processes_are_not_counted():
    other = subprocess.Popen(["sleep", "98"])  # not started by the checked command
    try:
        assert _check(["sh", "-c", "exit 4"]).returncode == 4
        out = _check(["true"])
        assert out.returncode == 0 and out.stderr == ""
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


SESSION_TEST = '''
import multiprocessing as mp
import os

import pytest


@pytest.fixture(scope="session")
def mock_data_cache():  # the suite's, which imports torch, is not needed here
    yield None


def test_forks_a_rank_from_a_forkserver():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["slow_exit"])
    proc = ctx.Process(target=os.getpid)
    proc.start()
    proc.join()
    assert proc.exitcode == 0
'''


def _session(tmp_path, *plugins):
    (tmp_path / "slow_exit.py").write_text("import atexit, time\natexit.register(time.sleep, 60)\n")
    (tmp_path / "test_session.py").write_text(SESSION_TEST)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    light = ["-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-p", "no:xdist", "-p", "no:timeout"]
    return _check([sys.executable, "-m", "pytest", "-q", *light, *plugins, "test_session.py"], cwd=tmp_path, env=env)


def test_the_session_ends_its_forkserver(tmp_path):
    out = _session(tmp_path, "-p", "tests.conftest")
    assert out.returncode == 0, out.stdout + out.stderr


def test_without_the_sessions_end_the_forkserver_is_left_and_named(tmp_path):
    out = _session(tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "multiprocessing.forkserver" in out.stderr


def test_every_pytest_run_of_make_test_is_checked_and_ci_runs_make_test():
    dry = subprocess.run(["make", "-n", "test"], cwd=REPO, capture_output=True, text=True, timeout=60)
    runs = [line for line in dry.stdout.splitlines() if " -m pytest " in line]
    assert len(runs) == 2, dry.stdout + dry.stderr  # the quick tests, then the rest under xdist
    assert all(line.split()[1] == "tests/support/no_process_left.py" for line in runs), runs
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert "make test" in ci and "set -euo pipefail" in ci

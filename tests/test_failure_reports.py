"""A rank's failure is reported once, though two handlers see it.

Under `python -m megatron_async.launch` the launcher reports a failure that is not
ours (failures.other_failure) and re-raises it; the excepthook the hooks install then
sees the same exception. Each report waits: a rank that lost a peer for
PEER_LOSS_GRACE_S, so torchrun names the rank with the cause; one with its own error
until the second of its error file has passed. Reported twice, a lost peer waited
twice as long and printed its line twice (seen: 5 s on a 2-rank CPU job).
"""

import json
import sys

import pytest

from megatron_async.megatron_lm.safety import failures

PEER_LOSS = "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:131"


@pytest.fixture
def sleeps(monkeypatch):
    waited = []
    monkeypatch.setattr(failures.time, "sleep", waited.append)
    return waited


@pytest.fixture
def excepthook(monkeypatch):
    """The excepthook the hooks install, over a previous hook that prints nothing."""
    monkeypatch.setattr(sys, "excepthook", lambda *args: None)
    failures.install_excepthook()
    return sys.excepthook


def test_a_lost_peer_seen_by_the_launcher_and_the_excepthook_waits_once(sleeps, excepthook, capsys):
    err = RuntimeError(PEER_LOSS)
    failures.other_failure(err)  # the launcher, which re-raises
    excepthook(RuntimeError, err, None)  # the same exception, uncaught
    assert sleeps == [failures.PEER_LOSS_GRACE_S]
    assert capsys.readouterr().err.count("lost a peer rank") == 1
    # negative control: another exception is another failure, and waits again
    failures.other_failure(RuntimeError(PEER_LOSS))
    assert sleeps == [failures.PEER_LOSS_GRACE_S] * 2


def test_a_rank_error_is_written_to_torchruns_error_file_once(sleeps, excepthook, tmp_path, monkeypatch):
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setenv("RANK", "1")
    err = ValueError("a shape that does not fit")
    failures.other_failure(err)
    first = error_file.read_text()
    excepthook(ValueError, err, None)
    assert len(sleeps) == 1 and 0 < sleeps[0] <= 1.05
    assert error_file.read_text() == first
    assert json.loads(first)["message"]["message"] == "rank 1: ValueError: a shape that does not fit"


def test_a_report_is_one_write_of_the_whole_line(monkeypatch, sleeps):
    """Ranks share an output (torchrun's console, a job log): a line written with its
    newline in one write stays whole. With print's two writes, two ranks' refusals ran
    together on one line of a job log (seen in tests/test_save_lock.py)."""
    writes = []

    class Stderr:
        def write(self, text):
            writes.append(text)

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stderr", Stderr())
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    failures.report("megatron-async: error: --save x is being written by another live job (rank 1)")
    failures.other_failure(RuntimeError(PEER_LOSS))
    assert writes[0] == "megatron-async: error: --save x is being written by another live job (rank 1)\n"
    assert len(writes) == 2 and writes[1].startswith("megatron-async: rank 0: lost a peer rank")
    assert writes[1].endswith("\n") and writes[1].count("\n") == 1


@pytest.mark.parametrize("launcher, said", [
    ({"TORCHELASTIC_RUN_ID": "r1"}, "torchrun names the rank that failed first"),
    ({"SLURM_JOB_ID": "77"}, "srun's first non-zero task"),
])
def test_a_lost_peer_names_where_the_first_failure_is_for_its_launcher(sleeps, capsys, monkeypatch, launcher, said):
    for name in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in launcher.items():
        monkeypatch.setenv(name, value)
    failures.other_failure(RuntimeError(PEER_LOSS))
    err = capsys.readouterr().err
    assert said in err and ("torchrun" in err) == ("TORCHELASTIC_RUN_ID" in launcher), err

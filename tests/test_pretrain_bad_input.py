"""Bad flags are refused before training, with one line naming the flag, on every rank."""

import pytest

from megatron_async.pretrain_gpt import main
from megatron_async.testing.launch import torchrun_pretrain

BASE = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "2"]


@pytest.fixture
def fake_dataset(tmp_path):
    prefix = tmp_path / "train_text_document"
    for ext in (".bin", ".idx"):
        (tmp_path / f"train_text_document{ext}").write_bytes(b"")
    return str(prefix)


CASES = {
    "missing data path": (["--train-data-path", "/nonexistent/train_text_document", "--tokenizer-model", "x.model"],
                          1, "--train-data-path"),
    "world size vs TP x PP": (["--pipeline-model-parallel-size", "2"], 3, "--pipeline-model-parallel-size"),
    "global batch vs micro batch x DP": (["--global-batch-size", "10", "--micro-batch-size", "4"], 2, "--global-batch-size"),
    "unknown schedule": (["--pipeline-schedule", "zigzag"], 1, "--pipeline-schedule"),
    "unknown optimizer": (["--optimizer", "adamax9000"], 1, "--optimizer"),
    "layers vs pipeline stages": (["--num-layers", "3", "--pipeline-model-parallel-size", "2"], 2, "--num-layers"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_flag_is_refused_with_its_name(name, monkeypatch, capsys):
    extra, world, flag = CASES[name]
    monkeypatch.setenv("WORLD_SIZE", str(world))
    base = [a for a in BASE if a != "--mock-data"] if "--train-data-path" in extra else BASE
    assert main(base + extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and flag in err[0], err


def test_missing_tokenizer_is_refused(fake_dataset, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "1")
    args = [a for a in BASE if a != "--mock-data"]
    assert main(args + ["--train-data-path", fake_dataset, "--tokenizer-model", "/nonexistent/tokenizer.model"]) == 2
    assert "--tokenizer-model" in capsys.readouterr().err


def test_every_rank_exits_without_hanging():
    """Under torchrun the job fails fast (torchrun may stop the other rank once one has
    exited, so at least one message is certain)."""
    args = BASE + ["--global-batch-size", "6", "--micro-batch-size", "4"]
    result = torchrun_pretrain(args, nproc=2, timeout_s=120)
    assert result.returncode != 0
    assert "error: --global-batch-size" in result.stdout, result.stdout[-3000:]


def test_each_rank_refuses_on_its_own():
    """Two ranks started side by side without torchrun (nothing stops either): each
    prints the message and exits 2 before any collective, so neither waits for the other."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = BASE + ["--global-batch-size", "6", "--micro-batch-size", "4"]
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-m", "megatron_async.pretrain_gpt", *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        for rank, proc in enumerate(procs):
            out, _ = proc.communicate(timeout=120)
            assert proc.returncode == 2, (rank, out[-3000:])
            assert "error: --global-batch-size" in out, (rank, out[-3000:])
    finally:
        for proc in procs:
            proc.kill()

"""Long runs stay flat and stop loudly: bounded send handles, NaN stop, launcher death.

Each test can fail: the handle count is compared between a short and a long run
(before the fix it grew by 2m sends per iteration per stage); the NaN run must exit
non-zero, name the iteration and stage, and leave no checkpoint; the orphan test
kills the launcher with SIGKILL and requires every worker gone within a deadline.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_async.testing.launch import torchrun_pretrain
from megatron_async.testing.multiprocess import run_distributed
from megatron_async.testing.tiny_gpt import TinyGPT, train_entry

MOCK = ["--mock-data", "--vocab-size", "256", "--num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--untie-embeddings-and-output-weights", "--eval-iters", "1"]


@pytest.mark.parametrize("pp", [2, 4])
def test_pending_send_handles_do_not_grow_with_run_length(pp):
    spec = TinyGPT(pp=pp, schedule="2bw", num_layers=4, global_batch_size=8, micro_batch_size=2)
    short = run_distributed(train_entry, pp, spec, 3)
    long = run_distributed(train_entry, pp, spec, 15)
    m = spec.num_microbatches(pp)
    for s, l in zip(short, long):
        assert l["pending_sends"] == s["pending_sends"], (s["rank"], s["pending_sends"], l["pending_sends"])
        # at most the activation and gradient sends of two batches
        assert l["pending_sends"] <= 4 * m, (l["rank"], l["pending_sends"])


def _strict_json_lines(path):
    def refuse(constant):
        raise ValueError(f"{path}: {constant} is not JSON")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("schedule", ["2bw", "1f1b"])
def test_non_finite_loss_stops_before_any_checkpoint(tmp_path, schedule):
    save, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    args = MOCK + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", schedule, "--train-iters", "60",
                   "--lr", "1e3", "--clip-grad", "0", "--lr-decay-style", "constant", "--log-interval", "1",
                   "--eval-interval", "1000", "--save", save, "--metrics-json", metrics]
    result = torchrun_pretrain(args, nproc=2, timeout_s=240)
    assert result.returncode != 0, result.stdout[-3000:]
    assert "stopped: iteration" in result.stdout and "pipeline stage" in result.stdout, result.stdout[-3000:]
    assert not save.exists() or not any(save.iterdir()), sorted(p.name for p in save.iterdir())
    records = _strict_json_lines(metrics)  # every line valid JSON, no NaN
    assert records, "the run logged nothing before it stopped"


def _children(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


MEGATRON_LOOP = ["--gpt", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                 "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
                 "--global-batch-size", "8", "--untie-embeddings-and-output-weights", "--mock-data",
                 "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--num-workers", "0",
                 "--rerun-mode", "disabled", "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw",
                 "--train-iters", "100000", "--lr", "1e-4", "--log-interval", "5", "--eval-interval", "100000",
                 "--eval-iters", "1"]


@pytest.mark.parametrize("entry", ["megatron_async.pretrain_gpt", "megatron_async.launch"])
def test_workers_exit_when_the_launcher_is_killed(tmp_path, entry):
    progress = tmp_path / "progress.jsonl"
    if entry == "megatron_async.launch":  # Megatron's own loop
        args = MEGATRON_LOOP + ["--metrics-json", progress]
    else:
        stats = tmp_path / "stats"
        progress = stats / "rank0.jsonl"
        args = MOCK + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw", "--train-iters",
                       "100000", "--log-interval", "5", "--eval-interval", "100000", "--rank-stats-dir", stats]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", entry, *map(str, args)]
    launcher = subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
    workers = []
    try:
        deadline = time.monotonic() + 180
        while not progress.exists() or not progress.read_text():
            assert launcher.poll() is None, "the run ended before it trained"
            assert time.monotonic() < deadline, "training did not start within 180 s"
            time.sleep(0.5)
        workers = _children(launcher.pid)
        assert len(workers) == 2, workers
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 15
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(w) for w in workers), f"workers {workers} outlived their launcher by 15 s"
    finally:
        for pid in workers + [launcher.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

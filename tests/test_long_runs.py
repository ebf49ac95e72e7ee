"""Long runs stay flat and end cleanly: bounded send handles, launcher death.

Each test can fail: the handle count is compared between a short and a long run (a
leak grows it by 2m sends per iteration per stage); the orphan test kills the launcher
of a run in Megatron's loop with SIGKILL and requires every process the job started
gone within a deadline (without the watches the workers, the checkpoint writer's
Managers and their resource trackers outlive it). The NaN stop is in
tests/test_megatron_loop.py.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.support.multiprocess import run_distributed
from tests.support.tiny_gpt import TinyGPT, train_entry
from tests.support.warm_launch import with_mock_data_cache


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


def _descendants(pid):
    found = []
    for child in _children(pid):
        found += [child, *_descendants(child)]
    return found


def _command(pid):
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read().replace("\0", " ")
    except OSError:
        return ""


# A spawned Manager re-imports the worker's main module, which under the patched script (as
# under the `megatron-async-pretrain` console script, launch.main from a bin/ file) is not
# megatron_async.launch: its watch must come from the package itself. "patched script" stands for `python pretrain_gpt.py` in a Megatron-LM checkout with
# patches/ applied: a training script at the checkout's root that never calls
# megatron_async.launch (the patched megatron.training installs the hooks); on a
# machine without CUDA it first sets up the CPU emulation and flags, as launch would.
ENTRIES = {"module": ["-m", "megatron_async.launch"], "patched script": None}
_PATCHED_SCRIPT = """
import sys

import megatron.training  # the patched package installs the hooks (and with them the launcher watch)

if __name__ == "__main__":  # as pretrain_gpt.py: a spawned child re-imports this module
    from megatron_async import cpu

    if cpu.setup_device("auto") == "cpu":
        from megatron_async.launch import with_cpu_flags

        sys.argv = [sys.argv[0], *with_cpu_flags(sys.argv[1:])]
    from megatron_async.megatron_lm.adapter import gpt, hooks

    assert hooks._INSTALLED and megatron.training.__file__.startswith({root!r})
    gpt.main()
"""


def _entry(name, tmp_path):
    if ENTRIES[name] is not None:
        return ENTRIES[name]
    from test_patches import _patched_copy

    root = _patched_copy(tmp_path)
    script = root / "pretrain_gpt_stand_in.py"
    script.write_text(_PATCHED_SCRIPT.format(root=str(root)))
    return [str(script)]


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_no_process_outlives_a_killed_job(tmp_path, entry):
    """SIGKILL of torchrun after a checkpoint save, for `-m megatron_async.launch` and a
    training script with the patched Megatron (ENTRIES): every process the job started (workers, the checkpoint writer's
    Managers, resource trackers, data-loader workers) is gone within 10 s. Both of the
    plugin's watches must act, and the test fails without either (checked): the workers
    have no launcher left to stop them (the launcher watch), and the Managers of
    workers that exit that way have no parent (a spawned child's parent watch), as
    after a worker killed outright."""
    progress = tmp_path / "progress.jsonl"
    # the jobs of a pytest worker share one mock-data index (built by the first, 1.5 s a job)
    args = with_mock_data_cache(MEGATRON_LOOP + ["--metrics-json", progress, "--save", tmp_path / "ckpt",
                                                 "--save-interval", "2"])
    if entry != "module":
        args = args[1:]  # the script is a GPT script
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           *_entry(entry, tmp_path), *map(str, args)]
    launcher = subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
    started = []
    try:
        deadline = time.monotonic() + 180
        while not (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").exists():
            assert launcher.poll() is None, "the run ended before it saved"
            assert time.monotonic() < deadline, "no checkpoint within 180 s"
            time.sleep(0.5)
        started = _descendants(launcher.pid)
        workers = _children(launcher.pid)
        assert len(workers) == 2, workers
        writers = [p for p in started if "multiprocessing.spawn" in _command(p)]
        assert writers, "the checkpoint writer's spawned Manager was expected"  # what a killed worker leaves
        os.kill(launcher.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in started) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = {p: _command(p)[:100] for p in started if _alive(p)}
        assert not left, f"outlived the job by 10 s: {left}"
    finally:
        for pid in started + [launcher.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

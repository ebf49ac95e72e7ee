"""What only NCCL would show, shown on the CPU: whole-device waits at a step end, and
sends left at exit.

On NCCL a send larger than its buffer (a real activation) runs on the GPU until its
receiver posts, and `torch.cuda.synchronize` / `empty_cache` wait for it. The CPU
emulation waits the same way (megatron_async/cpu_nccl.py, `EmulatedNccl.wait_all`),
failing with DeviceWaitError where NCCL would hang. Megatron waits on the device at step ends
with `--gpu-sniff-test-interval` (between all-rank collectives), `--train-sync-interval`
and `--empty-unused-memory-level` (both followed by an evaluation's all-rank timer
barrier). Each of them runs under 2bw in Megatron's loop at PP=2, and each hangs the
runtime without its step-end receive (tests.support.step_end_entry, the negative
control: a stage receives the next batch's activation only in its next step).

At exit, every rank reports the sends it posted and nobody waited on
(tests/support/exit_report.py): zero after the end of --train-iters, --exit-interval with
and without --save, and an exception (a diverging run stopped by our non-finite check,
at each rank that stopped on it); the control runtime hangs at --exit-interval without
--save and leaves sends at the exception.

Eight iterations with the log interval 1 and evaluations every 2 reach every step end
these flags act at, several times; the sniff test's 80 s of GEMM benchmarks are
replaced by one all-rank all-reduce and a synchronisation (step_end_entry).
"""

import json
import math
import re

import pytest

from tests.support.loop_runs import CPU, MODEL, TRAIN, logged_losses
from tests.support.warm_launch import warm_run

TWO_BW = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw"]
ENTRY = "tests.support.step_end_entry"
WAITS = {
    "gpu sniff test": ["--gpu-sniff-test-interval", "2"],
    "empty cache": ["--empty-unused-memory-level", "1", "--eval-interval", "2"],
    "train sync": ["--train-sync-interval", "1", "--eval-interval", "2"],
}
SEND_WAIT_S = 5  # an emulated whole-device wait fails after this (steps here take ~50 ms)
HANG_WAIT_S = 2  # the same in the negative controls where the wait is a hang: 40 steps' time
TIMEOUT_S = 240
# In the exception case each stage stops on its own numbers (pipeline/non_finite.py): the
# other rank stops too, a little later, or loses its peer first. torchrun's rule would stop
# it at once, so whether it wrote its exit report would be chance; here it exits on its own,
# and the tests read the reports of the ranks that stopped (their line says so). The hang
# controls read no report and keep the rule: their failed rank's peer would wait out its
# lost-peer grace.
PEERS_EXIT_S = 30


def _run(tmp_path, name, extra, old=False, send_wait_s=SEND_WAIT_S, peers_exit_s=PEERS_EXIT_S):
    report = tmp_path / f"{name}-exit"
    metrics = tmp_path / f"{name}.jsonl"
    env = {"MEGATRON_ASYNC_CPU_SEND_WAIT_S": str(send_wait_s),
           "MEGATRON_ASYNC_TEST_QUICK_SNIFF": "1",
           "MEGATRON_ASYNC_TEST_OLD_RUNTIME": "1" if old else "0", "MEGATRON_ASYNC_TEST_EXIT_REPORT": str(report)}
    proc = warm_run(ENTRY, ["--gpt", *CPU, *MODEL, *TRAIN, *TWO_BW, "--metrics-json", str(metrics), *extra], 2,
                    TIMEOUT_S, env=env, peers_exit_s=peers_exit_s)
    reports = {int(p.stem[4:]): json.loads(p.read_text()) for p in report.glob("rank*.json")}
    return proc, metrics, reports


def test_every_step_end_wait_runs_under_2bw(tmp_path):
    extra = [*WAITS["gpu sniff test"], "--empty-unused-memory-level", "2", "--train-sync-interval", "1",
             "--eval-interval", "2"]  # level 2 empties the cache at both of Megatron's places in a step
    proc, metrics, reports = _run(tmp_path, "all", extra)
    assert proc.returncode == 0, proc.stdout[-4000:]
    losses = logged_losses(metrics)
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses), losses
    assert proc.stdout.count("finished GPU sniff test") >= 4, "the sniff test did not run at every second step"
    assert reports == {r: {"rank": r, "outstanding_sends": 0} for r in (0, 1)}, reports


@pytest.mark.parametrize("name", list(WAITS))
def test_the_runtime_without_its_step_end_receive_hangs_there(tmp_path, name):
    """Negative control: the emulation catches the hang, naming the wait."""
    proc, _metrics, _reports = _run(tmp_path, name, WAITS[name], old=True, send_wait_s=HANG_WAIT_S, peers_exit_s=0)
    assert proc.returncode != 0, proc.stdout[-3000:]
    wait = "empty_cache" if name == "empty cache" else "synchronize"
    assert f"torch.cuda.{wait} waited {HANG_WAIT_S} s for a point-to-point send" in proc.stdout, proc.stdout[-3000:]


EXITS = {
    "end of --train-iters": [],
    "--exit-interval": ["--exit-interval", "3"],
    "--exit-interval with --save": ["--exit-interval", "3", "--save-interval", "100"],
    "exception": ["--lr", "1e3", "--clip-grad", "0", "--lr-decay-style", "constant", "--train-iters", "60",
                  "--no-check-for-nan-in-loss-and-grad"],
}
EXIT_CODES = {"exception": 3}


def _stopped(out: str) -> set[int]:
    """The ranks that stopped on the non-finite check, by their line."""
    return {int(r) for r in re.findall(r"megatron-async: rank (\d+): stopped: iteration", out)}


@pytest.mark.parametrize("name", list(EXITS))
def test_every_exit_leaves_no_send_outstanding(tmp_path, name):
    extra = EXITS[name] + (["--save", str(tmp_path / "ckpt")] if "--save" in name else [])
    proc, _metrics, reports = _run(tmp_path, name.replace(" ", "_"), extra)
    assert proc.returncode == EXIT_CODES.get(name, 0), proc.stdout[-4000:]
    ranks = _stopped(proc.stdout) if name == "exception" else {0, 1}
    assert ranks, proc.stdout[-4000:]
    assert {r: reports.get(r) for r in ranks} == {r: {"rank": r, "outstanding_sends": 0} for r in ranks}, reports


def test_the_old_runtime_hangs_at_exit_interval(tmp_path):
    """Negative control: at --exit-interval without --save the control runtime's last step
    leaves a send its receiver never posts for, and Megatron's exit path waits on the
    device (its timers): the emulation fails there, where NCCL would hang."""
    proc, _metrics, _reports = _run(tmp_path, "exit", EXITS["--exit-interval"], old=True, send_wait_s=HANG_WAIT_S,
                                    peers_exit_s=0)
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert f"waited {HANG_WAIT_S} s for a point-to-point send" in proc.stdout, proc.stdout[-3000:]


def test_the_old_exception_path_leaves_sends_outstanding(tmp_path):
    """Negative control: the exit report counts the sends the control runtime leaves at an exception."""
    proc, _metrics, reports = _run(tmp_path, "exception", EXITS["exception"], old=True)
    assert proc.returncode == 3, proc.stdout[-3000:]
    ranks = _stopped(proc.stdout)
    assert ranks and all(reports.get(r, {}).get("outstanding_sends", 0) > 0 for r in ranks), (ranks, reports)

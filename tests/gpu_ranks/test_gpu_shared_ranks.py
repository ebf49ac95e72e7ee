"""2bw across ranks on real NCCL, several ranks on one GPU (`make test-gpu-ranks`).

Each rank of a torchrun job gets its own NCCL_HOSTID and binds GPU 0
(tests.support.gpu.shared_gpu_entry): NCCL treats each rank as a host of its own
and carries the pipeline's traffic over its socket transport on loopback, with real
NCCL communicators, created lazily as Megatron-Core 0.19.2 leaves them, and CUDA streams.
Megatron's local layers, bf16, Muon, m = 8 microbatches (> p).

- 2bw PP=2 untied and tied, and PP=4, equal their `--simulated-delay 1` twins within
  LOSS_RTOL (bf16 round-off through other reduction orders, as tests/gpu states);
  control: synchronous training at PP=1 is further than that from the untied run.
- PP=2 x DP=2 with the distributed optimizer, --overlap-grad-reduce and --overlap-param-gather
  equals its twin at DP=2 within LOSS_RTOL.
- PP=2 x DP=2 with the distributed optimizer and --overlap-grad-reduce, MoE at EP=2,
  TP=2, and --empty-unused-memory-level 2 with --train-sync-interval 1: each finishes
  with a finite loss at every iteration.
- `--exit-signal-handler` with SIGTERM to the last stage's rank only: every rank stops
  after one agreed iteration and saves there; resumed, the losses equal an uninterrupted
  run's within RESUME_RTOL.
- Negative control: the tied link as it was (a pair all-reduce, then the first stage's
  first gradient receive at its first backward) hangs; the job is killed at
  HANG_TIMEOUT_S, naming the case. On the CPU dry run the emulation fails it instead.
Every case has a timeout that fails naming it.
"""

import os
import re
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from tests.support.gpu.compare import finite_losses, max_relative_difference
from tests.support.gpu.gpt_flags import MUON, gpt_flags, simulated_twin, two_bw
from tests.support.gpu.launch import (DETERMINISTIC_ENV, ROOT, rank_pids, read_metrics, run_with_timeout,
                                               subprocess_env, tail, train_losses)

ITERS = 10
LOSS_RTOL = 5e-3
TIMEOUT_S = 240
HANG_TIMEOUT_S = 90
BASE = gpt_flags(layers=4, hidden=128, heads=4, seq=128, micro_batch=2, global_batch=16, iters=ITERS, lr=5e-3,
                 impl="local") + MUON + ["--layout-invariant-init"]
TIED = [a for a in BASE if a != "--untie-embeddings-and-output-weights"]
RESUME_RTOL = 1e-6  # deterministic kernels and NCCL's ring: a resume is expected bit for bit
ENV = {**DETERMINISTIC_ENV, "MEGATRON_ASYNC_CPU_SEND_WAIT_S": "20"}  # the second: the CPU dry run's NCCL waits


def _command(nproc: int, args: list) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "tests.support.gpu.shared_gpu_entry", "--gpt", *map(str, args)]


def _job(record, case: str, nproc: int, args: list, timeout_s: float = TIMEOUT_S, env: dict | None = None):
    cmd = _command(nproc, args)
    try:
        proc = run_with_timeout(cmd, timeout_s, env={**ENV, **(env or {})}, nproc=nproc)
    except TimeoutError as err:
        raise TimeoutError(f"case {case!r}: {err}") from None
    record.launch(case, proc)
    return proc


def _losses(record, tmp_path, case: str, nproc: int, args: list) -> list[float]:
    metrics = tmp_path / f"{case.replace(' ', '_')}.jsonl"
    proc = _job(record, case, nproc, args + ["--metrics-json", metrics])
    assert proc.returncode == 0, f"case {case!r}:\n{tail(proc)}"
    return finite_losses(train_losses(read_metrics(metrics)), ITERS)


PAIRS = {  # case: (model flags, stages)
    "PP=2 untied": (BASE, 2),
    "PP=2 tied": (TIED, 2),
    "PP=4 untied": (BASE, 4),
}


@pytest.mark.parametrize("case", list(PAIRS))
def test_2bw_equals_its_simulated_twin(tmp_path, case, record):
    model, stages = PAIRS[case]
    twin = _losses(record, tmp_path, f"{case} twin", 1, model + simulated_twin(stages))
    pipelined = _losses(record, tmp_path, case, stages, model + two_bw(stages))
    difference = max_relative_difference(pipelined, twin)
    record(tolerance=LOSS_RTOL, max_rel_difference=difference, twin=twin, two_bw=pipelined)
    assert difference <= LOSS_RTOL, f"case {case!r}: 2bw differs from its twin by {difference:.2e}"
    if case == "PP=2 untied":  # the control: another algorithm is further than the tolerance
        sync = _losses(record, tmp_path, "synchronous PP=1", 1, model)
        control = max_relative_difference(pipelined, sync)
        record(control_vs_synchronous=control)
        assert control > LOSS_RTOL, f"synchronous training is within {LOSS_RTOL} of 2bw ({control:.2e}): no power"


RECIPE_OVERLAPS = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]


def test_2bw_with_the_recipes_overlaps_equals_its_twin_at_dp2(tmp_path, record):
    """PP=2 x DP=2 with the distributed optimizer's overlapped reduce and parameter gather (4 ranks)
    against its twin at PP=1 x DP=2 with the same flags (2 ranks)."""
    case = "PP=2 x DP=2, recipe overlaps"
    twin = _losses(record, tmp_path, f"{case} twin", 2, BASE + RECIPE_OVERLAPS + simulated_twin(2))
    pipelined = _losses(record, tmp_path, case, 4, BASE + RECIPE_OVERLAPS + two_bw(2))
    difference = max_relative_difference(pipelined, twin)
    record(tolerance=LOSS_RTOL, max_rel_difference=difference, twin=twin, two_bw=pipelined)
    assert difference <= LOSS_RTOL, f"case {case!r}: 2bw differs from its twin by {difference:.2e}"


LAYOUTS = {  # case: (ranks, flags)
    "PP=2 x DP=2, distributed optimizer, overlapped reduce": (
        4, BASE + two_bw(2) + ["--use-distributed-optimizer", "--overlap-grad-reduce"]),
    "PP=2 x EP=2, MoE": (4, BASE + two_bw(2) + ["--num-experts", 4, "--moe-router-topk", 2,
                                                "--expert-model-parallel-size", 2, "--moe-token-dispatcher-type",
                                                "alltoall", "--moe-aux-loss-coeff", 1e-2, "--disable-bias-linear"]),
    "PP=2 x TP=2": (4, BASE + two_bw(2) + ["--tensor-model-parallel-size", 2]),
    "PP=2 tied, empty cache and device syncs": (2, TIED + two_bw(2) + ["--empty-unused-memory-level", 2,
                                                                       "--train-sync-interval", 1]),
}


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_2bw_layouts_train(tmp_path, case, record):
    nproc, args = LAYOUTS[case]
    losses = _losses(record, tmp_path, case, nproc, args)
    record(losses=losses)


def _losses_by_iteration(path) -> dict:
    return {r["iteration"]: r["lm_loss"] for r in read_metrics(path) if "lm_loss" in r}


def _signalled(record, case: str, args: list, metrics, log, rank: int, after: int) -> str:
    """The job in the background; SIGTERM to `rank` alone once `after` iterations are logged.
    Returns its output; fails naming the case past TIMEOUT_S or when it exits otherwise than 0."""
    started, start = time.time(), time.monotonic()
    deadline = start + TIMEOUT_S
    with open(log, "w") as out:
        proc = subprocess.Popen(_command(2, args), stdout=out, stderr=subprocess.STDOUT, text=True,
                                env=subprocess_env(ENV), cwd=ROOT, start_new_session=True)
    try:
        while not metrics.exists() or len(_losses_by_iteration(metrics)) < after:
            assert proc.poll() is None, f"case {case!r} ended before the signal:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"case {case!r}: no {after} iterations in {TIMEOUT_S} s"
            time.sleep(0.2)
        os.kill(rank_pids(proc.pid)[rank], signal.SIGTERM)
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"case {case!r} did not finish within {TIMEOUT_S} s:\n{log.read_text()[-4000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log.read_text()
    assert proc.returncode == 0, f"case {case!r} exited {proc.returncode}:\n{text[-4000:]}"
    record.launch(f"{case}, signalled", SimpleNamespace(wall_s=time.monotonic() - start, stdout=text, started=started))
    return text


def test_sigterm_to_one_rank_stops_at_an_agreed_iteration_and_resumes(tmp_path, record):
    case = "SIGTERM to one rank"
    ckpt = tmp_path / "ckpt"
    flags = [a for a in BASE + two_bw(2)] + ["--lr-decay-style", "constant", "--exit-signal-handler",
                                             "--save-interval", 1000]
    flags[flags.index("--train-iters") + 1] = 1000
    first, second, whole = (tmp_path / f"{n}.jsonl" for n in ("first", "second", "whole"))
    text = _signalled(record, case, flags + ["--save", ckpt, "--metrics-json", first], first, tmp_path / "first.log",
                      rank=1, after=3)
    stops = re.findall(r"stopping after iteration (\d+), agreed by every rank", text)
    assert len(stops) == 1, f"case {case!r}: no agreed stop:\n{text[-4000:]}"
    stop = int(stops[0])
    end = stop + 3
    proc = _job(record, f"{case}, resumed", 2, flags + ["--save", ckpt, "--load", ckpt, "--exit-interval", end,
                                               "--metrics-json", second])
    assert proc.returncode == 0, f"case {case!r}, resumed:\n{tail(proc)}"
    proc = _job(record, f"{case}, uninterrupted", 2, flags + ["--exit-interval", end, "--metrics-json", whole])
    assert proc.returncode == 0, f"case {case!r}, uninterrupted:\n{tail(proc)}"
    stopped, resumed, reference = (_losses_by_iteration(p) for p in (first, second, whole))
    joined = {**{i: x for i, x in stopped.items() if i <= stop}, **resumed}
    assert sorted(joined) == sorted(reference) == list(range(1, end + 1)), (sorted(joined), sorted(reference))
    order = sorted(reference)
    difference = max_relative_difference([joined[i] for i in order], [reference[i] for i in order])
    record(stopped_after=stop, max_rel_difference=difference)
    assert difference <= RESUME_RTOL, f"case {case!r}: the resume differs by {difference:.2e}"


def test_negative_control_the_old_tied_link_hangs(record):
    switches = {"MEGATRON_ASYNC_TEST_OLD_TIED_CONTACT": "1", "MEGATRON_ASYNC_TEST_OLD_TIED_RECV": "1"}
    try:
        proc = _job(record, "old tied link", 2, TIED + two_bw(2), timeout_s=HANG_TIMEOUT_S, env=switches)
    except TimeoutError:
        record(hung=True)
        return
    record(hung=False, returncode=proc.returncode)
    # on the CPU dry run the emulation of NCCL fails where NCCL hangs
    assert proc.returncode != 0 and "first point-to-point operation" in proc.stdout, (
        f"case 'old tied link' neither hung nor failed at its first contact:\n{tail(proc)}")

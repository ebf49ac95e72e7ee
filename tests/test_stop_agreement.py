"""--exit-signal-handler and --exit-duration-in-mins under 2bw (pipeline/stop_agreement.py).

A 2bw PP=2 job (two gloo ranks, dropout 0.1) is stopped mid-training, by SIGTERM to the
last stage's worker only, or by its duration running out (`--exit-duration-in-mins 1`
with Megatron's clock started 57 s early). Every rank stops after the
same iteration, agreed LAG iterations after the first rank saw the reason, saves
there and exits 0. Resumed from that checkpoint, its per-iteration losses equal an
uninterrupted run's bit for bit. Every job runs from warm ranks (tests/support/warm_launch.py),
the stopped one in the background (WarmJob), so the signal goes to one worker as it
would under torchrun. All runs use one --train-iters (so one learning-rate
schedule) and stop with --exit-interval; the uninterrupted run is shared by both cases. That the agreement waits on nothing across
stages is tests/test_megatron_loop.py's collective audit.
"""

import json
import re
import signal
import time

import pytest
from test_megatron_loop import RESUME

from megatron_async.pipeline.stop_agreement import LAG
from tests.support.loop_runs import CPU, MODEL, TRAIN
from tests.support.warm_launch import WarmJob, warm_run



def _flags(tmp_path, name, extra):
    train = list(TRAIN)
    train[train.index("--train-iters") + 1] = "100000"
    model = [a for a in MODEL if a not in ("--hidden-dropout", "--attention-dropout", "0")]
    return ["--gpt", *CPU, *model, *train, *RESUME, "--pipeline-model-parallel-size", "2",
            "--pipeline-schedule", "2bw", "--lr-decay-style", "constant",
            "--metrics-json", str(tmp_path / f"{name}.jsonl"), *map(str, extra)]


def _start(argv, log, clock_ahead_s=None):
    """The launcher's job in the background; with `clock_ahead_s`, through the test entry
    whose Megatron training clock started that much earlier (--exit-duration-in-mins
    counts whole minutes)."""
    module = "megatron_async.launch" if clock_ahead_s is None else "tests.support.step_end_entry"
    env = {} if clock_ahead_s is None else {"MEGATRON_ASYNC_TEST_CLOCK_AHEAD_S": str(clock_ahead_s)}
    return WarmJob(module, argv, 2, env=env, log_path=log)


def _losses(path) -> dict:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["iteration"]: r["lm_loss"] for r in records if "lm_loss" in r}


WHOLE = 16  # iterations of the uninterrupted run at least; the cases stopped after 3-7 here (ends 7-11)


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The uninterrupted run's losses to a given iteration, shared by both cases: same flags
    and --train-iters, so the same trajectory to any iteration; --exit-interval only ends
    it. It runs WHOLE iterations, and again to a later iteration only for a case that
    stopped later than the last run covers."""
    runs = []

    def losses_to(end: int) -> dict:
        if not runs or max(runs[-1]) < end:
            tmp_path = tmp_path_factory.mktemp("whole")
            proc = warm_run("megatron_async.launch",
                            _flags(tmp_path, "whole", ["--exit-interval", max(end, WHOLE)]), 2, 300)
            assert proc.returncode == 0, proc.stdout[-4000:]
            runs.append(_losses(tmp_path / "whole.jsonl"))
        return runs[-1]

    return losses_to


SIGNALS = {"signal": signal.SIGTERM, "Ctrl-C": signal.SIGINT}


@pytest.mark.parametrize("reason", ["signal", "Ctrl-C", "duration"])
def test_a_stopped_2bw_job_saves_at_one_iteration_and_resumes_bit_for_bit(tmp_path, reason, whole):
    """Ctrl-C: SIGINT as Megatron's exit signal (`--exit-signal 2`, by number)."""
    ckpt = tmp_path / "ckpt"
    extra = ["--save", ckpt, "--save-interval", 100000]
    extra += (["--exit-signal-handler"] if reason == "signal" else ["--exit-signal-handler", "--exit-signal", "2"]
              if reason == "Ctrl-C" else ["--exit-duration-in-mins", 1])
    log = tmp_path / "stopped.log"
    # the duration case: Megatron's clock starts 57 s ahead, so the minute runs out 3 s after its start (seen
    # here after iteration 1: the stop is agreed LAG iterations later, mid-training all the same)
    job = _start(_flags(tmp_path, "stopped", extra), log, clock_ahead_s=57 if reason == "duration" else None)
    try:
        if reason in SIGNALS:
            deadline = time.monotonic() + 180
            while len(_losses(tmp_path / "stopped.jsonl")) < 3 if (tmp_path / "stopped.jsonl").exists() else True:
                assert job.running(), log.read_text()[-3000:]
                assert time.monotonic() < deadline, "no third iteration within 180 s"
                time.sleep(0.1)
            job.signal(1, SIGNALS[reason])  # the last stage only; the first learns it by agreement
        finished = job.wait(300)
        code, out = finished.returncode, finished.stdout
    finally:
        job.kill()
    assert code == 0, out[-4000:]
    stop = int(re.search(r"stopping after iteration (\d+), agreed by every rank", out).group(1))
    seen = int(re.search(r"\(seen after iteration (\d+)\)", out).group(1))
    assert stop - seen == LAG
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(stop)
    stopped = _losses(tmp_path / "stopped.jsonl")
    assert max(stopped) == stop  # no rank trained past the agreed iteration
    end = stop + 4
    proc = warm_run("megatron_async.launch", _flags(tmp_path, "resumed", ["--load", ckpt, "--exit-interval", end]), 2,
                    300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    resumed = _losses(tmp_path / "resumed.jsonl")
    assert sorted(resumed) == list(range(stop + 1, end + 1))
    uninterrupted = whole(end)
    assert {i: uninterrupted[i] for i in resumed} == resumed  # bit for bit
    assert {i: uninterrupted[i] for i in stopped} == stopped

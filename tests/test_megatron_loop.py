"""2bw inside Megatron's own training loop (`megatron.training.pretrain`), CPU and gloo.

(2bw against its `--simulated-delay 1` twin: tests/test_twin_matrix.py and
tests/test_twin_matrix_across_ranks.py.)

- The collective audit: from the second iteration to the end of training no
  collective's group holds ranks of two pipeline stages; the same check fails when
  a world all-reduce is injected.
- A flag 2bw cannot honour stops every rank before training, naming the flag.
- A resume equals the uninterrupted run (observed bitwise; allowed 1e-6 relative).
"""

import json
import math
import shutil

import pytest

from tests.support.loop_runs import CPU, ITERS, MODEL, TIMEOUT_S, TRAIN, assert_same, logged_losses, losses, run


def _audit(tmp_path, nproc, extra, inject=False, with_async=False, old_exit_checks=False):
    directory = tmp_path / "audit"
    env = {"MEGATRON_ASYNC_AUDIT_DIR": str(directory), "MEGATRON_ASYNC_AUDIT_INJECT": "1" if inject else "0",
           "MEGATRON_ASYNC_AUDIT_MEGATRON_EXIT": "1" if old_exit_checks else "0"}
    proc, _ = run(tmp_path, "audit", nproc, extra, module="tests.support.collective_audit", env=env)
    assert proc.returncode == 0, proc.stdout[-4000:]
    ranks = [json.loads((directory / f"rank{r}.json").read_text()) for r in range(nproc)]
    stage = {r["rank"]: r["stage"] for r in ranks}
    assert all(r["steps"] == ITERS for r in ranks), [r["steps"] for r in ranks]
    crossing = [(r["rank"], name, group, *timing) for r in ranks for name, group, *timing in r["records"]
                if len({stage[g] for g in group}) > 1]
    blocking = [c for c in crossing if len(c) == 3]
    if with_async:
        return blocking, [c for c in crossing if len(c) == 4], sum(len(r["records"]) for r in ranks)
    return blocking, sum(len(r["records"]) for r in ranks)


AUDITED = {
    "adam, PP=2": (2, []),
    "muon+ef, PP=2": (2, ["--optimizer", "muon", "--delay-correction", "ef"]),
    "adam dist-opt, overlapped reduce and gather, PP=2 x DP=2": (4, ["--use-distributed-optimizer",
                                                                    "--overlap-grad-reduce",
                                                                    "--overlap-param-gather"]),
    "moe with aux loss, EP=2, dist-opt, both overlaps, PP=2 x DP=2": (4, [
        "--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01", "--disable-bias-linear",
        "--expert-model-parallel-size", "2", "--use-distributed-optimizer", "--overlap-grad-reduce",
        "--overlap-param-gather"]),
    # Megatron's layer-wise optimizer drives its per-rank optimizers only with --bf16
    "muon+ef layer-wise dist-opt, both overlaps, PP=2 x DP=2": (4, [
        "--optimizer", "muon", "--delay-correction", "ef", "--use-distributed-optimizer", "--bf16",
        "--overlap-grad-reduce", "--overlap-param-gather"]),
}


@pytest.mark.parametrize("case", list(AUDITED))
def test_no_collective_spans_two_stages_in_steady_state(tmp_path, case):
    nproc, extra = AUDITED[case]
    crossing, total = _audit(tmp_path, nproc, extra + ["--pipeline-model-parallel-size", "2",
                                                       "--pipeline-schedule", "2bw"])
    assert not crossing, crossing[:10]
    if nproc > 2:
        assert total > 0, "data-parallel runs must record their in-stage collectives"


def test_the_stop_agreement_spans_stages_only_without_blocking(tmp_path):
    """--exit-signal-handler and --exit-duration-in-mins under 2bw: the only collectives
    across stages are the stop agreement's non-blocking all-reduces, each waited
    LAG iterations after it was posted (pipeline/stop_agreement.py), when every rank
    has long posted it, or at the end of training."""
    from megatron_async.pipeline.stop_agreement import LAG

    blocking, non_blocking, _ = _audit(tmp_path, 2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule",
                                                      "2bw", "--exit-signal-handler", "--exit-duration-in-mins",
                                                      "600"], with_async=True)
    assert not blocking, blocking[:10]
    assert non_blocking and all(name == "all_reduce" for _rank, name, _group, _timing in non_blocking)
    waited = [t for *_rest, t in non_blocking if t["waited"] is not None]
    # LAG iterations later; the last ones at the end of training, where every rank has stopped
    early = [t for t in waited if t["waited"] - t["posted"] < LAG and t["waited"] < ITERS]
    assert waited and not early, early


def test_audit_catches_an_injected_cross_stage_all_reduce(tmp_path):
    crossing, _ = _audit(tmp_path, 2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw"],
                         inject=True)
    assert any(name == "all_reduce" and len(group) == 2 for _rank, name, group in crossing), crossing
    # and Megatron's own per-iteration exit checks, which 2bw replaces with the agreement
    blocking, _, _ = _audit(tmp_path / "megatron", 2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule",
                                                       "2bw", "--exit-signal-handler", "--exit-duration-in-mins",
                                                       "600"], with_async=True, old_exit_checks=True)
    assert {name for _rank, name, _group in blocking} >= {"all_gather", "all_reduce"}, blocking[:10]


def test_a_refused_flag_stops_every_rank_before_training(tmp_path):
    """Under torchrun a refusal is one line naming the flag and a non-zero exit, before
    any iteration (each refused flag: tests/test_refusals.py)."""
    from tests.support.launch import torchrun_megatron

    # torchrun itself (not warm ranks), in its own session: killed with its ranks on a timeout
    proc = torchrun_megatron([*CPU, *MODEL, *TRAIN, "--pipeline-model-parallel-size", "2",
                              "--pipeline-schedule", "2bw", "--log-params-norm"], 2, TIMEOUT_S, warm=False)
    assert proc.returncode != 0
    lines = [line for line in proc.stdout.splitlines() if "megatron-async: error:" in line]
    assert lines and all("--log-params-norm" in line for line in lines), proc.stdout[-3000:]
    assert "iteration        1/" not in proc.stdout


def test_install_names_a_missing_megatron_function(monkeypatch):
    from megatron_async.megatron_lm.adapter import hooks

    missing = hooks.Hook("megatron.training.training", "no_such_function", "nowhere", lambda f: f, hooks.EVERY)
    monkeypatch.setattr(hooks, "HOOKS", hooks.HOOKS + (missing,))
    monkeypatch.setattr(hooks, "_INSTALLED", {})
    with pytest.raises(hooks.MissingHookError, match="megatron.training.training.no_such_function"):
        hooks.install()
    assert not hooks._INSTALLED, "nothing may be hooked when a name is missing"


RESUME = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--ckpt-format", "torch_dist"]
# the resume tests' negative controls: a checkpoint without its marker resumes without our state,
# through a test entry that lets such a resume through (tests/support/step_end_entry.py)
OLD_ENTRY = "tests.support.step_end_entry"
MARKERLESS_RESUME = {"MEGATRON_ASYNC_TEST_OLD_MARKERLESS_RESUME": "1"}


RESUMED = {"adam": [], "muon+ef": ["--optimizer", "muon", "--delay-correction", "ef"],
           "adam, weight prediction": ["--delay-correction", "predict"],
           "adam, DC-ASGD": ["--delay-correction", "dc-asgd"],
           "adam, Nesterov look-ahead": ["--delay-correction", "nesterov"],
           "adam, stale-global clipping": ["--clip-grad-mode", "stale-global", "--clip-grad", "0.05"]}


def _saved_at_4(tmp_path, ckpt, name):
    """A copy of `ckpt`'s iteration-4 checkpoint alone, its tracker at 4: what a run
    stopped at 4 would have left (the run itself went on to 8)."""
    copy = tmp_path / name
    shutil.copytree(ckpt / "iter_0000004", copy / "iter_0000004")
    (copy / "latest_checkpointed_iteration.txt").write_text("4")
    return copy


@pytest.mark.parametrize("optimizer", list(RESUMED))
def test_resume_equals_the_uninterrupted_run_with_dropout(tmp_path, optimizer):
    """The uninterrupted run saves at iteration 4 and trains on to 8; resumed from that
    checkpoint, the losses of 5-8 equal its own (observed bitwise; allowed 1e-6). The
    save comes while the next batch's warm-up forwards are due: without the RNG
    snapshot taken before them the losses differ in the 3rd digit; with stale-global
    clipping, without the saved global norms. Negative control (Muon + EF,
    stale-global): the same checkpoint without its marker resumes elsewhere."""
    base = RESUMED[optimizer] + RESUME + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw"]
    ckpt = tmp_path / "ckpt"
    full = losses(tmp_path, "full", 2, base + ["--save", str(ckpt), "--save-interval", "4"])
    assert json.loads((ckpt / "iter_0000004" / "megatron_async.json").read_text())["weight_stash"]
    saved = _saved_at_4(tmp_path, ckpt, "saved")
    bare = _saved_at_4(tmp_path, ckpt, "bare")  # for the negative control: the same checkpoint without its marker
    (bare / "iter_0000004" / "megatron_async.json").unlink()
    proc, second = run(tmp_path, "second", 2, base + ["--load", str(saved), "--save", str(saved),
                                                      "--save-interval", "100"])
    assert proc.returncode == 0, proc.stdout[-4000:]
    resumed = logged_losses(second)
    assert len(resumed) == ITERS - 4
    assert_same(resumed, full[4:])
    if optimizer in ("muon+ef", "adam, stale-global clipping"):  # without our state it resumes elsewhere
        proc, without = run(tmp_path, "without", 2, base + ["--load", str(bare)], module=OLD_ENTRY,
                            env=MARKERLESS_RESUME)
        assert proc.returncode == 0, proc.stdout[-4000:]
        with pytest.raises(AssertionError):
            assert_same(logged_losses(without), full[4:])


def test_2bw_resumes_from_a_1f1b_checkpoint(tmp_path):
    """A checkpoint of Megatron's 1F1B holds no stash: 2bw resumes from it with the
    older weight version equal to the newest, and trains on."""
    ckpt = str(tmp_path / "ckpt")
    proc, first = run(tmp_path, "first", 2, RESUME + ["--pipeline-model-parallel-size", "2", "--save", ckpt,
                                                       "--save-interval", "4", "--exit-interval", "4"])
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert not (tmp_path / "ckpt" / "iter_0000004" / "megatron_async.json").exists()
    proc, second = run(tmp_path, "second", 2, RESUME + ["--pipeline-model-parallel-size", "2",
                                                        "--pipeline-schedule", "2bw", "--load", ckpt])
    assert proc.returncode == 0, proc.stdout[-4000:]
    records = [r for r in map(json.loads, second.read_text().splitlines()) if "lm_loss" in r]
    assert [r["iteration"] for r in records] == list(range(5, ITERS + 1))
    assert all(math.isfinite(r["lm_loss"]) for r in records)


def test_tensorboard_gets_2bw_losses(tmp_path):
    """Megatron's own --tensorboard-dir works under 2bw: the last rank writes the lm loss."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = tmp_path / "tb"
    proc, _ = run(tmp_path, "tb", 2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw",
                                      "--tensorboard-dir", str(board), "--tensorboard-log-interval", "1"])
    assert proc.returncode == 0, proc.stdout[-4000:]
    events = EventAccumulator(str(board))
    events.Reload()
    assert "lm loss" in events.Tags()["scalars"], events.Tags()
    steps = [e.step for e in events.Scalars("lm loss")]
    assert steps == list(range(1, ITERS + 1)), steps


PP2 = ["--pipeline-model-parallel-size", "2"]
SCHEDULES = {"no pipelining": (1, []), "1f1b": (2, PP2),
             "interleaved 1f1b": (2, PP2 + ["--num-virtual-stages-per-pipeline-rank", "2"]),
             "2bw": (2, PP2 + ["--pipeline-schedule", "2bw"])}


@pytest.mark.parametrize("schedule,megatron_check", [(s, False) for s in SCHEDULES] + [("1f1b", True), ("2bw", True)])
def test_non_finite_loss_stops_every_schedule_before_any_checkpoint(tmp_path, schedule, megatron_check):
    """--lr 1e3 --clip-grad 0 diverges. Megatron's own NaN check (in the gradient sync) or,
    with --no-check-for-nan-in-loss-and-grad, ours (after the step) stops the run with
    exit code 3 and one line naming the pipeline stage and the iteration, numbered as
    the metrics file numbers them (its last record is the iteration before); nothing is
    checkpointed (--save-interval would save at the end) and the metrics stay strict JSON."""
    nproc, layout = SCHEDULES[schedule]
    save = tmp_path / "ckpt"
    extra = layout + ["--lr", "1e3", "--clip-grad", "0", "--lr-decay-style", "constant", "--save", str(save),
                      "--save-interval", "1000", "--train-iters", "60"]
    if not megatron_check:
        extra.append("--no-check-for-nan-in-loss-and-grad")
    proc, metrics = run(tmp_path, "nan", nproc, extra)
    assert proc.returncode == 3, proc.stdout[-3000:]
    stops = [line for line in proc.stdout.splitlines() if ": stopped: iteration " in line]
    assert stops and all("on pipeline stage " in line for line in stops), proc.stdout[-3000:]
    from megatron_async.megatron_lm.safety.save_lock import LOCK_NAME

    assert not save.exists() or not [p for p in save.iterdir() if p.name != LOCK_NAME]  # the job's lock only

    def refuse(constant):
        raise ValueError(constant)

    records = [json.loads(line, parse_constant=refuse) for line in metrics.read_text().splitlines()]
    logged = max((r["iteration"] for r in records if "lm_loss" in r), default=0)
    stopped = {int(line.split(": stopped: iteration ")[1].split(":")[0]) for line in stops}
    assert stopped == {logged + 1}, (stopped, logged)


def test_simulated_delay_zero_keeps_no_stash(tmp_path):
    """`--simulated-delay 0` (the default) builds no weight stash: its checkpoint says it
    holds none of ours. The control, `--simulated-delay 1`, holds a stash and trains
    another trajectory."""
    runs = {}
    for name, delay in (("zero", "0"), ("one", "1")):
        ckpt = tmp_path / f"ckpt_{name}"
        proc, metrics = run(tmp_path, name, 1, ["--simulated-delay", delay, "--train-iters", "4",
                                                "--save", str(ckpt), "--save-interval", "4"])
        assert proc.returncode == 0, proc.stdout[-4000:]
        path = ckpt / "iter_0000004" / "megatron_async.json"
        assert (ckpt / "iter_0000004").is_dir()
        marker = json.loads(path.read_text()) if path.exists() else {}
        runs[name] = (marker, logged_losses(metrics))
    assert runs["zero"][0] == {} and runs["one"][0].get("weight_stash"), (runs["zero"][0], runs["one"][0])
    assert len(runs["zero"][1]) == 4 and runs["zero"][1][2:] != runs["one"][1][2:]


def test_stage_delay_list(tmp_path):
    """`--simulated-delay 1,1` is `--simulated-delay 1 --simulated-pipeline-stages 2`; `1,0`
    (the last stage current) is another trajectory. Exactness of per-stage delays against
    an independent reference: tests/test_stage_delays.py."""
    clip = ["--clip-grad", "0.1"]
    listed = losses(tmp_path, "listed", 1, clip + ["--simulated-delay", "1,1"])
    twin = losses(tmp_path, "twin", 1, clip + ["--simulated-delay", "1", "--simulated-pipeline-stages", "2"])
    mixed = losses(tmp_path, "mixed", 1, clip + ["--simulated-delay", "1,0"])
    assert listed == twin
    assert max(abs(a - b) for a, b in zip(mixed[2:], twin[2:])) > 1e-5


def test_stale_global_clipping_is_the_one_cross_stage_reduction(tmp_path):
    """`--clip-grad-mode stale-global` in Megatron's loop: the only collectives spanning
    stages are its non-blocking norm all-reduces over the pipeline's ranks (a host gloo group,
    so no whole-device wait at a step end waits for them), one per optimizer step and norm group; and it clips otherwise
    than stage-local clipping (clip 0.05 acts at every step)."""
    common = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw", "--clip-grad", "0.05"]
    blocking, non_blocking, _ = _audit(tmp_path, 2, common + ["--clip-grad-mode", "stale-global"], with_async=True)
    assert not blocking, blocking[:10]
    assert {(name, tuple(group)) for _rank, name, group, _timing in non_blocking} == {("all_reduce", (0, 1))}
    waited = [t for *_rest, t in non_blocking if t["waited"] is not None]
    # read a step later; the last step's, at the end of training, where every rank has stopped
    late = [t for t in waited if t["waited"] <= t["posted"] and t["posted"] < ITERS]
    assert waited and not late, late
    stale = logged_losses(tmp_path / "audit.jsonl")
    local = losses(tmp_path, "local", 2, common)
    # iterations 1-3 run at W0, W0, W1, and step 0 (W0 -> W1) has no older global norm: equal;
    # iteration 4 runs at W2, from step 1, the first clipped by a stale global norm
    assert len(stale) == ITERS and stale[:3] == local[:3]
    assert stale[3] != local[3]


def test_every_hooked_megatron_name_is_listed_in_the_docs():
    """docs/megatron_lm.md's table names every function the plugin hooks."""
    from pathlib import Path

    from megatron_async.megatron_lm.adapter import hooks

    doc = (Path(__file__).resolve().parents[1] / "docs" / "megatron_lm.md").read_text()
    missing = [f"{h.module}.{h.name}" for h in hooks.HOOKS
               if f"{h.module.replace(':', '.')}.{h.name}`" not in doc and f"`{h.name}`" not in doc]
    assert not missing, f"docs/megatron_lm.md does not list: {missing}"

"""No silent fresh start over checkpoints; a bad --save or checkpoint is named before training.

The file-system rules (megatron_lm/safety/checkpoint_guard.py) on fake checkpoint trees,
the same cases through Megatron's own argument validation with the plugin
(tests/test_refusals.py's harness), and real runs: a truncated checkpoint and a
changed --train-iters on resume are each reported in one line naming what to do.
"""

import os

import pytest
from test_megatron_loop import RESUME
from test_refusals import BASE, _without

from megatron_async.megatron_lm.safety.checkpoint_guard import resume_problem, unwritable_save
from tests.support.loop_runs import run
from tests.support.refusals import check_in_one_process


def _checkpoints(root, iterations, tracker=None, incomplete=()):
    for i in iterations:
        d = root / f"iter_{i:07d}"
        d.mkdir(parents=True)
        (d / ".metadata").write_bytes(b"")
    for i in incomplete:  # a save that never finished: no .metadata
        (root / f"iter_{i:07d}").mkdir(parents=True)
    if tracker is not None:
        (root / "latest_checkpointed_iteration.txt").write_text(str(tracker))
    return root


def test_checkpoints_without_a_tracker_are_not_started_over(tmp_path):
    run = _checkpoints(tmp_path / "run", [10, 20], incomplete=[30])
    problem = resume_problem(str(run), str(run), None)
    assert "newest complete one: iteration 20" in problem and "--ckpt-step 20" in problem
    assert resume_problem(str(run), str(run), 20) is None  # the flag it names resumes


def test_a_misspelt_load_does_not_overwrite_the_real_checkpoints(tmp_path):
    run = _checkpoints(tmp_path / "run", [10, 20], tracker=20)
    problem = resume_problem(str(tmp_path / "rnu"), str(run), None)
    assert f"--save {run} holds checkpoints newer" in problem and "iteration 20" in problem
    assert f"--load {run}" in problem
    assert resume_problem(str(run), str(run), None) is None  # resuming from them is fine


def test_a_requeue_after_a_kill_between_a_save_and_its_tracker_resumes(tmp_path):
    """Killed after finishing iteration 24 but before the tracker named it: the requeue
    (--load = --save) resumes from 22 as Megatron does, and retrains 23-24 bit for bit.
    Control: a run that would start elsewhere over those checkpoints is still refused."""
    run = _checkpoints(tmp_path / "run", [20, 22, 24], tracker=22)
    assert resume_problem(str(run), str(run), None) is None
    assert "newer" in resume_problem(str(tmp_path / "other"), str(run), None)
    assert "newer" in resume_problem(str(run), str(run), 20)  # an explicit older --ckpt-step still is


def test_the_first_job_of_a_requeue_chain_starts(tmp_path):
    assert resume_problem(str(tmp_path / "new"), str(tmp_path / "new"), None) is None
    empty = tmp_path / "empty"
    empty.mkdir()
    assert resume_problem(str(empty), str(empty), None) is None
    half = _checkpoints(tmp_path / "half", [], incomplete=[10])  # only an unfinished save
    assert resume_problem(str(half), str(half), None) is None


def test_an_unwritable_save_is_named(tmp_path):
    assert unwritable_save(str(tmp_path / "a" / "b")) is None  # created later by Megatron
    assert "/proc" in unwritable_save("/proc/x") and "--save /proc/x" in unwritable_save("/proc/x")
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert unwritable_save(str(blocker / "ckpt")) is not None


def test_refused_through_megatrons_validation(tmp_path):
    run = _checkpoints(tmp_path / "run", [10, 20], tracker=20)
    untracked = _checkpoints(tmp_path / "untracked", [10])
    args = [a for a in BASE if a not in ("--eval-interval", "10")]
    every = ["--save-interval", "10"]
    cases = {
        "misspelt load": (BASE + ["--load", str(tmp_path / "rnu"), "--save", str(run), *every], "--load " + str(run)),
        "no tracker": (BASE + ["--load", str(untracked), "--save", str(untracked), *every], "--ckpt-step 10"),
        "unwritable save": (BASE + ["--save", "/proc/x", *every], "--save /proc/x"),
        "no eval interval": (args, "--eval-interval is required"),
        # the negative control, training on past iteration 20 (a --train-iters below it is refused, below)
        "resume": (_without(BASE, "--train-iters") + ["--train-iters", "30", "--load", str(run), "--save", str(run),
                                                      *every], None),
        "first job": (BASE + ["--load", str(tmp_path / "new"), "--save", str(tmp_path / "new"), *every], None),
    }
    found = check_in_one_process({k: {"world": 1, "argv": a} for k, (a, _) in cases.items()}, tmp_path)
    for name, (_, needle) in cases.items():
        if needle is None:
            assert not found[name]["refused"], (name, found[name]["error"])
        else:
            assert found[name]["refused"] and needle in found[name]["error"], (name, found[name]["error"])
    assert not (tmp_path / "new").exists()  # nothing created by the check


TORCH_DIST = RESUME + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw"]


def test_a_truncated_checkpoint_is_named_with_the_previous_complete_one(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc, _ = run(tmp_path, "first", 2, TORCH_DIST + ["--save", str(ckpt), "--save-interval", "4"])
    assert proc.returncode == 0, proc.stdout[-4000:]
    shard = max((ckpt / "iter_0000008").glob("*.distcp"), key=os.path.getsize)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    proc, _ = run(tmp_path, "second", 2, TORCH_DIST + ["--load", str(ckpt), "--train-iters", "8"])
    assert proc.returncode == 2, proc.stdout[-4000:]
    line = next(line for line in proc.stdout.splitlines() if "cannot be loaded" in line)
    assert "iter_0000008" in line and "previous complete checkpoint is iteration 4 (--ckpt-step 4)" in line, line
    assert f"damaged: {shard}" in line, line  # the truncated file itself


@pytest.fixture(scope="module")
def tied_checkpoint(tmp_path_factory):
    """A tied 2bw PP=2 run checkpointed (torch_dist) at iterations 4 and 8: its resume reads
    the checkpoint in Megatron's argument validation already (the tie must match)."""
    from tests.support import loop_runs as loop

    root = tmp_path_factory.mktemp("tied")
    model = loop.MODEL
    loop.MODEL = [a for a in model if a != "--untie-embeddings-and-output-weights"]
    try:
        proc, _ = run(root, "first", 2, TORCH_DIST + ["--save", str(root / "ckpt"), "--save-interval", "4"])
    finally:
        loop.MODEL = model
    assert proc.returncode == 0, proc.stdout[-4000:]
    return root / "ckpt"


DAMAGE = {"a 0-byte shard": lambda d: max(d.glob("*.distcp"), key=os.path.getsize),
          "a deleted .metadata": lambda d: d / ".metadata"}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_checkpoint_read_in_validation_is_named_and_the_advice_works(tmp_path, tied_checkpoint, damage,
                                                                               monkeypatch):
    import shutil

    from tests.support import loop_runs as loop

    monkeypatch.setattr(loop, "MODEL", [a for a in loop.MODEL if a != "--untie-embeddings-and-output-weights"])
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tied_checkpoint, ckpt)
    path = DAMAGE[damage](ckpt / "iter_0000008")
    if damage == "a 0-byte shard":
        path.write_bytes(b"")
    else:
        path.unlink()
    proc, _ = run(tmp_path, "second", 2, TORCH_DIST + ["--load", str(ckpt), "--train-iters", "8"])
    assert proc.returncode == 2, proc.stdout[-4000:]
    line = next(line for line in proc.stdout.splitlines() if "cannot be loaded" in line)
    assert "iter_0000008" in line and "previous complete checkpoint is iteration 4 (--ckpt-step 4)" in line, line
    assert f"damaged: {path}" in line, line
    # the advice as given: resume from 4 into the same --save (the damaged 8 is saved again)
    proc, _ = run(tmp_path, "advice", 2, TORCH_DIST + ["--load", str(ckpt), "--save", str(ckpt), "--save-interval",
                                                       "4", "--ckpt-step", "4", "--train-iters", "8"])
    assert proc.returncode == 0, proc.stdout[-4000:]


def _marker(directory):
    import json

    return json.loads((directory / "megatron_async.json").read_text())


def _flip_16_bytes(directory, mask=0x01):
    """XOR 16 bytes in the middle of the output layer's exp_avg chunk (else the largest exp_avg
    chunk), found through `.metadata`; the file keeps its size. Returns the file."""
    from torch.distributed.checkpoint import FileSystemReader

    chunks = [(index.fqn, info) for index, info in FileSystemReader(str(directory)).read_metadata().storage_data.items()
              if "exp_avg" in index.fqn and "exp_avg_sq" not in index.fqn]
    _, info = max(chunks, key=lambda c: ("output_layer" in c[0], c[1].length))
    path = directory / info.relative_path
    data = bytearray(path.read_bytes())
    middle = info.offset + info.length // 2
    data[middle:middle + 16] = bytes(b ^ mask for b in data[middle:middle + 16])
    path.write_bytes(bytes(data))
    return path


def test_every_file_of_a_saved_checkpoint_has_the_checksum_of_the_rank_that_wrote_it(tied_checkpoint, tmp_path):
    """Read from the fixture's files alone: every file but the marker is recorded, each .distcp
    by the rank its name gives, and checked at load by that rank; a flipped one is found there."""
    import re
    import shutil

    from megatron_async.megatron_lm.checkpoint.checksums import problems

    for iteration in ("iter_0000004", "iter_0000008"):
        directory = tied_checkpoint / iteration
        recorded = _marker(directory)["checksums"]
        on_disk = {str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file()}
        assert set(recorded["files"]) == on_disk - {"megatron_async.json"}, recorded["files"].keys()
        for name, entry in recorded["files"].items():
            writer = re.search(r"__(\d+)_\d+\.distcp$", name)
            assert entry["rank"] == (int(writer.group(1)) if writer else 0), (name, entry)
        assert {e["rank"] for e in recorded["files"].values()} == {0, 1}
        assert problems(str(directory), recorded, 0, 2) == problems(str(directory), recorded, 1, 2) == []
    copy = tmp_path / "iter_0000008"
    shutil.copytree(tied_checkpoint / "iter_0000008", copy)
    flipped = _flip_16_bytes(copy)
    writer = int(re.search(r"__(\d+)_", flipped.name).group(1))
    recorded = _marker(copy)["checksums"]
    found = problems(str(copy), recorded, writer, 2)
    assert len(found) == 1 and found[0].startswith(f"{flipped} (its xxh3_64 checksum differs"), found
    assert problems(str(copy), recorded, 1 - writer, 2) == []  # the other rank does not read it
    assert len(problems(str(copy), recorded, 0, 1)) == 1  # one rank checks every file


def test_flipped_bytes_in_a_shard_are_refused_before_training_naming_the_file(tmp_path, tied_checkpoint,
                                                                               monkeypatch):
    """16 bytes of an exp_avg XOR-ed, the file's size unchanged: Megatron's load reads it without a
    word, so the resume trains (the negative control is the opt-out's run below). Refused on every
    rank with the file and the previous complete checkpoint, whose advice then resumes, verified."""
    import shutil

    from tests.support import loop_runs as loop

    monkeypatch.setattr(loop, "MODEL", [a for a in loop.MODEL if a != "--untie-embeddings-and-output-weights"])
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tied_checkpoint, ckpt)
    flipped = _flip_16_bytes(ckpt / "iter_0000008")
    longer = ["--train-iters", "12", "--override-opt_param-scheduler"]
    proc, _ = run(tmp_path, "flipped", 2, TORCH_DIST + ["--load", str(ckpt)] + longer, peers_exit_s=30)
    assert proc.returncode == 2, proc.stdout[-4000:]
    lines = [x for x in proc.stdout.splitlines() if x.startswith("megatron-async: error:") and "cannot be loaded" in x]
    assert {x[-len("(rank 0)"):] for x in lines} == {"(rank 0)", "(rank 1)"}, proc.stdout[-4000:]
    assert f"damaged: {flipped} (its xxh3_64 checksum differs" in lines[0], lines[0]
    assert "previous complete checkpoint is iteration 4 (--ckpt-step 4)" in lines[0], lines[0]
    assert " iteration        9/" not in proc.stdout
    # the advice as given: iteration 8 moved out of --save, resume from 4 into it
    shutil.move(ckpt / "iter_0000008", tmp_path / "damaged_iter_0000008")
    proc, _ = run(tmp_path, "advice", 2, TORCH_DIST + ["--load", str(ckpt), "--save", str(ckpt), "--save-interval",
                                                       "4", "--ckpt-step", "4", "--train-iters", "8"])
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert f"files of {ckpt / 'iter_0000004'} (" in proc.stdout and "match their checksums" in proc.stdout


def test_the_opt_out_takes_no_checksums_and_a_checkpoint_without_them_loads_saying_so(tmp_path, tied_checkpoint,
                                                                                       monkeypatch):
    """--no-checkpoint-checksums: the flipped checkpoint loads unverified and trains (as any
    resume without checksums does), and its save records none; a checkpoint without checksums
    (this one, or one written by a megatron-async without them) loads, saying so."""
    import shutil

    from tests.support import loop_runs as loop

    monkeypatch.setattr(loop, "MODEL", [a for a in loop.MODEL if a != "--untie-embeddings-and-output-weights"])
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tied_checkpoint, ckpt)
    _flip_16_bytes(ckpt / "iter_0000008")
    proc, metrics = run(tmp_path, "opted_out", 2, TORCH_DIST + [
        "--load", str(ckpt), "--save", str(ckpt), "--save-interval", "4", "--train-iters", "12",
        "--override-opt_param-scheduler", "--no-checkpoint-checksums"])
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert f"--no-checkpoint-checksums: the files of {ckpt / 'iter_0000008'} are loaded unverified" in proc.stdout
    assert " iteration       12/" in proc.stdout
    held = _marker(ckpt / "iter_0000012")
    assert held["weight_stash"] and "checksums" not in held, held
    proc, _ = run(tmp_path, "unverified", 2, TORCH_DIST + ["--load", str(ckpt), "--train-iters", "12"])
    assert proc.returncode == 0, proc.stdout[-4000:]
    said = [x for x in proc.stdout.splitlines() if "holds no checksums of its files" in x]
    assert len(said) == 1 and str(ckpt / "iter_0000012") in said[0], proc.stdout[-4000:]


def test_a_flipped_metadata_is_one_line_before_megatrons_argument_dump(tmp_path, tied_checkpoint, monkeypatch):
    """16 bytes of `.metadata` XOR-ed: every rank reads it in Megatron's argument validation
    (the tie check), where torch.distributed.checkpoint logs a traceback for each failed read.
    Refused there, in one line naming the file, with no traceback and no argument dump."""
    import shutil

    from tests.support import loop_runs as loop

    monkeypatch.setattr(loop, "MODEL", [a for a in loop.MODEL if a != "--untie-embeddings-and-output-weights"])
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tied_checkpoint, ckpt)
    metadata = ckpt / "iter_0000008" / ".metadata"
    data = bytearray(metadata.read_bytes())
    data[len(data) // 2:len(data) // 2 + 16] = bytes(b ^ 0x01 for b in data[len(data) // 2:len(data) // 2 + 16])
    metadata.write_bytes(bytes(data))
    proc, _ = run(tmp_path, "flipped_metadata", 2, TORCH_DIST + ["--load", str(ckpt), "--train-iters", "12",
                                                                 "--override-opt_param-scheduler"])
    assert proc.returncode == 2, proc.stdout[-4000:]
    errors = {x for x in proc.stdout.splitlines() if x.startswith("megatron-async: error:")}
    assert len(errors) == 1, errors
    assert f"damaged: {metadata} (its xxh3_64 checksum differs" in errors.pop()
    assert "Traceback" not in proc.stdout and "-- arguments --" not in proc.stdout, proc.stdout[-4000:]


def _edit_marker(directory, **changes):
    """Change fields of a checkpoint's megatron_async.json (None removes one), as a hand edit would."""
    import json

    marker = _marker(directory)
    for key, value in changes.items():
        if value is None:
            marker.pop(key)
        else:
            marker[key] = value
    (directory / "megatron_async.json").write_text(json.dumps(marker))


def test_an_edited_marker_is_refused_and_so_is_a_stash_it_denies(tmp_path, tied_checkpoint):
    """megatron_async.json edited to `"weight_stash": false` would resume with both weight
    versions equal while the stash is there: refused in argument validation, naming the file
    and --no-checkpoint-checksums. Under that opt-out, and for a marker without its own
    checksum, the stash its files hold and the marker denies is refused too, naming
    --no-load-optim. Control: the intact checkpoint passes."""
    import shutil

    from tests.support import loop_runs as loop

    model = [a for a in loop.MODEL if a != "--untie-embeddings-and-output-weights"]
    resume = [*model, *loop.TRAIN, *TORCH_DIST, "--train-iters", "12", "--override-opt_param-scheduler"]
    copies = {}
    for name in ("intact", "edited", "unsealed"):
        copies[name] = tmp_path / name
        shutil.copytree(tied_checkpoint, copies[name])
    _edit_marker(copies["edited"] / "iter_0000008", weight_stash=False)
    _edit_marker(copies["unsealed"] / "iter_0000008", weight_stash=False, marker_checksum=None)
    cases = {"intact": resume + ["--load", str(copies["intact"])],
             "edited": resume + ["--load", str(copies["edited"])],
             "edited, opted out": resume + ["--load", str(copies["edited"]), "--no-checkpoint-checksums"],
             "unsealed": resume + ["--load", str(copies["unsealed"])]}
    found = check_in_one_process({k: {"world": 2, "argv": a} for k, a in cases.items()}, tmp_path)
    assert not found["intact"]["refused"], found["intact"]["error"]
    edited = found["edited"]["error"]
    assert str(copies["edited"] / "iter_0000008" / "megatron_async.json") in edited, edited
    assert "checksum it holds of its own content" in edited and "--no-checkpoint-checksums" in edited, edited
    for name in ("edited, opted out", "unsealed"):
        error = found[name]["error"]
        assert found[name]["refused"] and "holds a 2bw weight stash but its megatron_async.json says it holds none" \
            in error and "--no-load-optim" in error, (name, error)


def test_a_longer_run_on_resume_names_the_scheduler_flags(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc, _ = run(tmp_path, "first", 2, TORCH_DIST + ["--save", str(ckpt), "--save-interval", "4",
                                                      "--exit-interval", "4"])
    assert proc.returncode == 0, proc.stdout[-4000:]
    longer = [a if a != "8" else "16" for a in TORCH_DIST]  # ITERS is 8 in tests/support/loop_runs.py's TRAIN
    proc, metrics = run(tmp_path, "longer", 2, longer + ["--load", str(ckpt), "--train-iters", "16"])
    assert proc.returncode == 2, proc.stdout[-4000:]
    assert "--override-opt_param-scheduler" in proc.stdout and "--use-checkpoint-opt_param-scheduler" in proc.stdout
    assert "is 16 in this run but 8 in the checkpoint" in proc.stdout, proc.stdout[-3000:]  # iterations, not samples
    assert not metrics.exists() or "lm_loss" not in metrics.read_text()
    proc, _ = run(tmp_path, "override", 2, TORCH_DIST + ["--load", str(ckpt), "--train-iters", "16",
                                                         "--override-opt_param-scheduler"])
    assert proc.returncode == 0, proc.stdout[-4000:]  # the flag it names works


def test_damaged_files_are_found_by_their_recorded_sizes(tmp_path):
    """torch format: a truncated .pt is no whole zip archive; an intact one is not named."""
    import torch

    from megatron_async.megatron_lm.safety.checkpoint_guard import damaged_files

    good, bad = tmp_path / "mp_rank_00" / "model_optim_rng.pt", tmp_path / "mp_rank_01" / "model_optim_rng.pt"
    for path in (good, bad):
        path.parent.mkdir()
        torch.save({"w": torch.arange(1000.0)}, path)
    bad.write_bytes(bad.read_bytes()[:-100])
    assert damaged_files(str(tmp_path)) == [str(bad)]


TORCH_FORMAT = [a for a in TORCH_DIST if a not in ("--ckpt-format", "torch_dist")] + ["--ckpt-format", "torch"]


@pytest.fixture(scope="module")
def torch_format_checkpoint(tmp_path_factory):
    """A 2bw PP=2 run checkpointed in the torch format at iterations 4 and 8."""
    root = tmp_path_factory.mktemp("torn")
    proc, _ = run(root, "first", 2, TORCH_FORMAT + ["--save", str(root / "ckpt"), "--save-interval", "4"])
    assert proc.returncode == 0, proc.stdout[-4000:]
    return root / "ckpt"


def _torn_copy(ckpt, tmp_path, ranks):
    import shutil

    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    torn = []
    for rank in ranks:
        path = copy / "iter_0000008" / f"mp_rank_00_{rank:03d}" / "model_optim_rng.pt"
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        torn.append(path)
    return copy, torn


@pytest.mark.parametrize("ranks", [(0, 1), (1,)], ids=["every rank's file", "rank 1's file"])
def test_a_torn_torch_format_checkpoint_fails_naming_the_file_and_the_rank(tmp_path, torch_format_checkpoint, ranks,
                                                                          monkeypatch):
    """Megatron's loader prints "could not load the checkpoint" and calls a bare sys.exit()
    (exit code 0). Under torchrun the job fails instead: each rank that found a damaged file
    names it, itself and the previous complete iteration, and torchrun's root cause is
    such a rank, not a healthy peer that lost its connection. Negative control: with
    Megatron's exit passed through, the job exits 0 having trained nothing."""
    import re

    from tests.support.launch import _torchrun
    from tests.support.loop_runs import CPU, MODEL, TRAIN

    from tests.support.warm_launch import warm_run

    copy, torn = _torn_copy(torch_format_checkpoint, tmp_path, ranks)
    argv = ["--gpt", *CPU, *MODEL, *TRAIN, *TORCH_FORMAT, "--load", str(copy), "--train-iters", "12",
            "--override-opt_param-scheduler"]
    # torchrun where its root cause is read (one damaged rank beside a healthy one); warm ranks,
    # which skip the imports, where every rank is damaged and each says so with exit code 2
    if ranks == (0, 1):
        proc = warm_run("megatron_async.launch", argv, 2, 300, peers_exit_s=30)
    else:
        proc = _torchrun(["-m", "megatron_async.launch", *argv], 2, 300, None)
    out = proc.stdout
    assert proc.returncode != 0, out[-4000:]
    for rank, path in zip(ranks, torn):
        line = next((x for x in out.splitlines() if "damaged: " in x and str(path) in x and x.endswith(f"(rank {rank})")), None)
        assert line and "previous complete checkpoint is iteration 4 (--ckpt-step 4)" in line, out[-4000:]
    if ranks == (0, 1):
        assert all(f"warm_launch: rank {rank} of 2 failed (exit code 2)" in out for rank in ranks), out[-4000:]
    else:
        root_cause = out[out.index("Root Cause"):]
        assert int(re.search(r"rank\s*:\s*(\d+)", root_cause).group(1)) in ranks, root_cause
        assert "cannot be loaded" in root_cause and re.search(r"exitcode\s*:\s*2\b", root_cause), root_cause
    assert " iteration        9/" not in out
    # negative control (warm ranks): Megatron's own exit there ends the job with 0 when every
    # rank's file is damaged; with only rank 1's, rank 1 exits 0 and the one rank that fails,
    # torchrun's root cause, is the healthy rank 0 that lost its peer
    monkeypatch.setenv("MEGATRON_ASYNC_TEST_OLD_LOAD_EXIT", "1")
    proc = warm_run("tests.support.step_end_entry", argv, 2, 300, peers_exit_s=30)
    assert "could not load the checkpoint" in proc.stdout, proc.stdout[-4000:]
    if ranks == (0, 1):
        assert proc.returncode == 0, proc.stdout[-4000:]
    else:
        failed = re.findall(r"warm_launch: rank (\d) of 2 failed", proc.stdout)
        assert proc.returncode != 0 and failed == ["0"], proc.stdout[-4000:]


def test_a_resume_that_will_train_nothing_says_so_or_is_refused(tmp_path, capsys):
    """At the tracker's iteration the run is finished: Megatron evaluates and exits 0, said up
    front. Below it, Megatron would train nothing with a schedule that ended before the
    checkpoint: refused in one line naming --train-iters and the ways on; --skip-train, which
    only evaluates, and --finetune, which starts at iteration 0, are not. Beyond it the run
    trains, without a word."""
    from types import SimpleNamespace

    from megatron_async.megatron_lm.safety.failures import FlagError
    from megatron_async.megatron_lm.safety.resume_checks import _check_iterations_left_to_train

    root = _checkpoints(tmp_path / "ckpt", [15], tracker=15)

    def args(iters, skip_train=False, finetune=False):
        return SimpleNamespace(load=str(root), ckpt_step=None, train_iters=iters, skip_train=skip_train,
                               finetune=finetune)

    for iters, said in ((15, True), (20, False)):
        _check_iterations_left_to_train(args(iters))
        out = capsys.readouterr().out
        assert ("nothing will be trained" in out) is said, (iters, out)
    with pytest.raises(FlagError) as refused:
        _check_iterations_left_to_train(args(12))
    line = str(refused.value)
    assert "--train-iters 12 is below iteration 15" in line and "\n" not in line, line
    assert all(way in line for way in ("raise --train-iters above 15", "--ckpt-step", "--skip-train")), line
    assert "nothing will be trained" not in capsys.readouterr().out
    for only_evaluates_or_starts_at_0 in (args(12, skip_train=True), args(12, finetune=True)):
        _check_iterations_left_to_train(only_evaluates_or_starts_at_0)
        assert capsys.readouterr().out == ""

"""A `--load` that is not a checkpoint directory is refused; one with nothing to resume says so.

Megatron reads `--load`/latest_checkpointed_iteration.txt and starts from scratch, with
one warning among its log, when it cannot: a `--load` naming a file or one iteration's
folder would train afresh and exit 0. Both are refused before training (through
Megatron's validation with the plugin, tests/support/refusals.py), and the flags the
refusal names resume. A missing or empty `--load` still starts (the first job of a
requeue chain), with one line of ours that says so, printed before Megatron's argument
dump, which still follows.
"""

import json

from test_checkpoint_guard import _checkpoints
from test_refusals import BASE, _without

from megatron_async.megatron_lm.safety.checkpoint_guard import fresh_start_notice, resume_problem
from tests.support.refusals import check_in_one_process
from tests.support.warm_launch import warm_python

# training on past the checkpoints below (a --train-iters below them is refused: test_checkpoint_guard.py)
BASE = _without(BASE, "--train-iters") + ["--train-iters", "30"]


def test_a_file_or_one_iterations_folder_is_refused_naming_the_directory(tmp_path):
    run = _checkpoints(tmp_path / "run", [10, 20], tracker=20)
    tracker = run / "latest_checkpointed_iteration.txt"
    problem = resume_problem(str(tracker), None, None)
    assert f"--load {tracker} is a file" in problem and f"(here: --load {run})" in problem, problem
    (tmp_path / "notes.txt").write_text("")
    assert "is a file" in resume_problem(str(tmp_path / "notes.txt"), None, None)
    problem = resume_problem(str(run / "iter_0000010"), None, None)
    assert f"pass --load {run} --ckpt-step 10" in problem, problem
    assert resume_problem(str(run), None, 10) is None  # what it advises resumes


def test_the_fresh_start_line_only_where_nothing_is_loaded(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    run = _checkpoints(tmp_path / "run", [10], tracker=10)
    assert "does not exist: this run starts from scratch" in fresh_start_notice(str(tmp_path / "new"))
    assert "holds no checkpoint" in fresh_start_notice(str(empty))
    assert fresh_start_notice(str(run)) is None
    assert fresh_start_notice(str(tmp_path / "new"), pretrained=str(run)) is None  # Megatron loads that instead
    assert fresh_start_notice(None) is None


def test_refused_through_megatrons_validation(tmp_path):
    run = _checkpoints(tmp_path / "run", [10, 20], tracker=20)
    cases = {
        "a file": (["--load", str(run / "latest_checkpointed_iteration.txt")], f"(here: --load {run})"),
        "one iteration's folder": (["--load", str(run / "iter_0000020")], f"--load {run} --ckpt-step 20"),
        "missing": (["--load", str(tmp_path / "new")], None),  # the negative control: it starts
        "the advice": (["--load", str(run), "--ckpt-step", "20"], None),
    }
    found = check_in_one_process({k: {"world": 1, "argv": BASE + a} for k, (a, _) in cases.items()}, tmp_path)
    for name, (_, needle) in cases.items():
        if needle is None:
            assert not found[name]["refused"], (name, found[name]["error"])
        else:
            assert found[name]["refused"] and needle in found[name]["error"], (name, found[name]["error"])
            assert found[name]["by"] == "megatron-async", found[name]


def test_a_missing_load_says_it_starts_from_scratch_before_the_argument_dump(tmp_path):
    run = _checkpoints(tmp_path / "run", [10], tracker=10)
    argvs = [BASE + ["--load", str(tmp_path / "new")], BASE + ["--load", str(run)]]
    out = warm_python("tests.support.parse_each", ["1", "load", json.dumps(argvs)], 300)
    assert out.returncode == 0, out.stdout[-3000:]
    missing, resumed = out.stdout.split("=== case\n")[1:]
    said = [line for line in missing.splitlines() if line.startswith("megatron-async: --load")]
    assert said == [f"megatron-async: --load {tmp_path / 'new'} does not exist: this run starts from scratch "
                    "(iteration 0), as Megatron does"], missing[-3000:]
    dump = "------------------------ arguments"
    assert dump in missing and missing.index(said[0]) < missing.index(dump), missing[-3000:]
    assert "starts from scratch" not in resumed and dump in resumed, resumed[-3000:]

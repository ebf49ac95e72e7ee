"""2bw's state (weight stash, delay correction, RNG) in Megatron's checkpoint formats.

`--ckpt-format torch_dist` carries it inside the optimizer's sharded state dict
(tests/test_megatron_loop.py); `--ckpt-format torch` has no per-rank objects, so
every rank writes its own file next to the checkpoint (megatron_lm/checkpoint/side_files.py).
Each format resumes bitwise (tolerance 1e-6 relative, as test_megatron_loop.py) with
dropout; what megatron_async.json promises is checked on load (a missing rank file
stops the run naming it); and a layout the stash cannot be laid out for is refused
before training, naming both layouts. A delay correction switched on or off at a
resume, and --no-load-optim, are allowed and said.
"""

import json
import shutil

import pytest
from test_megatron_loop import MARKERLESS_RESUME, OLD_ENTRY, RESUME
from tests.support.loop_runs import ITERS, assert_same, logged_losses, losses, run

TORCH = [a for a in RESUME if a not in ("--ckpt-format", "torch_dist")] + ["--ckpt-format", "torch"]
PP2_2BW = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw"]
SAVED_AT = 4


def _first_half(tmp_path, nproc, flags):
    ckpt = tmp_path / "ckpt"
    proc, first = run(tmp_path, "first", nproc, flags + ["--save", str(ckpt), "--save-interval", str(SAVED_AT),
                                                         "--exit-interval", str(SAVED_AT)])
    assert proc.returncode == 0, proc.stdout[-4000:]
    return ckpt, first


def _resumed_losses(tmp_path, nproc, flags, ckpt, first, name="second", **kw):
    proc, second = run(tmp_path, name, nproc, flags + ["--load", str(ckpt), "--save", str(ckpt),
                                                       "--save-interval", "100"], **kw)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return logged_losses(first, second)


CASES = {
    "muon + DC-ASGD": (2, PP2_2BW + ["--optimizer", "muon", "--delay-correction", "dc-asgd"]),
    "adam, weight prediction": (2, PP2_2BW + ["--delay-correction", "predict"]),  # two stash slots
    # one file per data-parallel rank too (the distributed optimizer's resume:
    # tests/test_distributed_optimizer_resume.py)
    "adam + EF, DP=2": (4, PP2_2BW + ["--delay-correction", "ef"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_torch_format_resume_equals_the_uninterrupted_run(tmp_path, case):
    nproc, flags = CASES[case]
    flags = TORCH + flags
    full = losses(tmp_path, "full", nproc, flags)
    ckpt, first = _first_half(tmp_path, nproc, flags)
    bare = tmp_path / "bare"  # for the negative control: the same checkpoint, our state removed
    shutil.copytree(ckpt, bare)
    shutil.rmtree(bare / f"iter_{SAVED_AT:07d}" / "megatron_async")
    (bare / f"iter_{SAVED_AT:07d}" / "megatron_async.json").unlink()
    marker = json.loads((ckpt / f"iter_{SAVED_AT:07d}" / "megatron_async.json").read_text())
    assert marker["weight_stash"] and marker["per_rank_state"] == "files" and marker["ckpt_format"] == "torch"
    assert len(list((ckpt / f"iter_{SAVED_AT:07d}" / "megatron_async").glob("*.pt"))) == nproc
    resumed = _resumed_losses(tmp_path, nproc, flags, ckpt, first)
    assert len(resumed) == ITERS
    assert_same(resumed, full)
    if case == "muon + DC-ASGD":  # negative control: the same checkpoint without our state resumes elsewhere
        without = _resumed_losses(tmp_path, nproc, flags, bare, first, name="without", module=OLD_ENTRY,
                                  env=MARKERLESS_RESUME)
        with pytest.raises(AssertionError):
            assert_same(without, full)


@pytest.fixture(scope="module")
def torch_checkpoint(tmp_path_factory):
    """One torch-format 2bw PP=2 checkpoint at iteration SAVED_AT, saved once for the tests below."""
    ckpt, _ = _first_half(tmp_path_factory.mktemp("torch_checkpoint"), 2, TORCH + PP2_2BW)
    return ckpt


def _copy(checkpoint, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint, ckpt)
    return ckpt


def test_a_missing_rank_file_stops_the_resume_naming_it(tmp_path, torch_checkpoint):
    flags = TORCH + PP2_2BW
    ckpt = _copy(torch_checkpoint, tmp_path)
    files = sorted((ckpt / f"iter_{SAVED_AT:07d}" / "megatron_async").glob("*.pt"))
    files[-1].unlink()
    proc, metrics = run(tmp_path, "second", 2, flags + ["--load", str(ckpt)])
    assert proc.returncode != 0
    assert f"{files[-1].name} is missing" in proc.stdout, proc.stdout[-4000:]
    assert not metrics.exists() or "lm_loss" not in metrics.read_text()


def test_a_promised_stash_that_was_not_restored_stops_the_run(tmp_path, torch_checkpoint):
    """A torch-format checkpoint whose marker promises a stash that nothing restores
    (as older versions wrote them, without the marker's own checksum): an error, not a
    silent start with equal versions."""
    flags = TORCH + PP2_2BW
    ckpt = _copy(torch_checkpoint, tmp_path)
    iteration = ckpt / f"iter_{SAVED_AT:07d}"
    shutil.rmtree(iteration / "megatron_async")
    marker = json.loads((iteration / "megatron_async.json").read_text())
    for key in ("per_rank_state", "layout", "ckpt_format", "marker_checksum"):
        marker.pop(key)
    (iteration / "megatron_async.json").write_text(json.dumps(marker))
    proc, _ = run(tmp_path, "second", 2, flags + ["--load", str(ckpt)])
    assert proc.returncode != 0
    assert "says it holds the 2bw weight stash, but it was not restored" in proc.stdout, proc.stdout[-4000:]


def _refusal(tmp_path, name, nproc, flags) -> str:
    """The one error line of a run refused before training (exit 2, no iteration logged)."""
    proc, metrics = run(tmp_path, name, nproc, flags)
    assert proc.returncode == 2, proc.stdout[-4000:]
    assert not metrics.exists() or "lm_loss" not in metrics.read_text()
    return next(line for line in proc.stdout.splitlines() if "megatron-async: error:" in line)


def test_another_layout_is_refused_before_training_naming_both(tmp_path, torch_checkpoint):
    ckpt = _copy(torch_checkpoint, tmp_path)
    line = _refusal(tmp_path, "pp1", 1, TORCH + ["--simulated-delay", "1", "--load", str(ckpt)])
    assert "saved at PP=2 TP=1 EP=1 DP=1" in line and "this run's PP=1 TP=1 EP=1 DP=1" in line, line


def test_a_synchronous_resume_says_it_does_not_use_the_stash(tmp_path, torch_checkpoint):
    ckpt = _copy(torch_checkpoint, tmp_path)
    proc, metrics = run(tmp_path, "sync", 2, TORCH + ["--pipeline-model-parallel-size", "2", "--load", str(ckpt)])
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "this run is synchronous and does not use it" in proc.stdout
    assert "lm_loss" in metrics.read_text()


def test_ef_switched_on_at_a_resume_starts_empty_and_says_so(tmp_path, torch_checkpoint):
    """A checkpoint saved without a delay correction, resumed with --delay-correction ef:
    it trains, and says that EF starts with no previous update."""
    ckpt = _copy(torch_checkpoint, tmp_path)
    proc, metrics = run(tmp_path, "ef", 2, TORCH + PP2_2BW + ["--delay-correction", "ef", "--load", str(ckpt)])
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "holds no delay-correction state; --delay-correction ef starts without a previous update" in proc.stdout
    assert "lm_loss" in metrics.read_text()


def test_ef_switched_off_at_a_resume_leaves_its_state_unused(tmp_path):
    ckpt, _ = _first_half(tmp_path, 2, TORCH + PP2_2BW + ["--delay-correction", "ef"])
    proc, metrics = run(tmp_path, "no_ef", 2, TORCH + PP2_2BW + ["--load", str(ckpt)])
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "holds delay-correction state; this run has no --delay-correction and does not use it" in proc.stdout
    assert "lm_loss" in metrics.read_text()


@pytest.mark.parametrize("saved, resumed", [("none", "predict"), ("dc-asgd", "ef")])
def test_another_delay_correction_at_a_resume_is_refused_naming_both(tmp_path, torch_checkpoint, saved, resumed):
    """Weight prediction's stash has another shape, and DC-ASGD's state is not EF's: refused
    before training, naming the saved correction (without the check: an error at load)."""
    if saved == "none":
        ckpt = _copy(torch_checkpoint, tmp_path)
    else:
        ckpt, _ = _first_half(tmp_path, 2, TORCH + PP2_2BW + ["--delay-correction", saved])
    line = _refusal(tmp_path, "other", 2, TORCH + PP2_2BW + ["--delay-correction", resumed, "--load", str(ckpt)])
    assert f"--delay-correction {resumed}: the checkpoint" in line and f"saved with --delay-correction {saved}" in line


def test_another_delay_at_a_resume_is_refused_naming_the_saved_one(tmp_path, torch_checkpoint):
    """2bw's stash holds one earlier version; a two-step delay needs two: refused before
    training (without the check: an error when the stash is loaded)."""
    ckpt = _copy(torch_checkpoint, tmp_path)
    line = _refusal(tmp_path, "delay2", 1, TORCH + ["--simulated-delay", "2", "--load", str(ckpt)])
    assert "--simulated-delay 2: the checkpoint" in line and "resume with a delay of 1" in line, line


def test_no_load_optim_says_the_stash_is_not_loaded(tmp_path, torch_checkpoint):
    ckpt = _copy(torch_checkpoint, tmp_path)
    proc, metrics = run(tmp_path, "fresh_optim", 2, TORCH + PP2_2BW + ["--no-load-optim", "--load", str(ckpt)])
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "--no-load-optim: the checkpoint's weight stash is not loaded; both weight versions start equal" \
        in proc.stdout, proc.stdout[-4000:]
    assert "lm_loss" in metrics.read_text()


def test_a_resume_with_nothing_left_to_train_evaluates_and_exits(tmp_path):
    """Resumed at its last iteration, a 2bw run takes no step; Megatron's final evaluation
    still runs through the 2bw runtime."""
    flags = TORCH + PP2_2BW
    ckpt = tmp_path / "ckpt"
    proc, _ = run(tmp_path, "whole", 2, flags + ["--save", str(ckpt), "--save-interval", "100"])
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)
    proc, metrics = run(tmp_path, "done", 2, flags + ["--load", str(ckpt)])
    assert proc.returncode == 0, proc.stdout[-4000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert not any("lm_loss" in r for r in records), records  # no step taken
    assert any("final_val_loss" in r for r in records), records



# The torch_dist stash is saved laid out like the model's weights, so it reshards with
# them. No dropout (another layout draws other masks) and no clipping (2bw clips each
# stage by its own norm, so another stage split clips differently); then a resume at
# another layout equals a resume at the saved one to round-off (reduction order), 1e-5.
RESHARD = ["--ckpt-format", "torch_dist", "--clip-grad", "0"]
LAYOUTS = {
    "PP=4": (4, ["--pipeline-model-parallel-size", "4", "--pipeline-schedule", "2bw"]),
    "PP=2 x TP=2": (4, PP2_2BW + ["--tensor-model-parallel-size", "2"]),
    "PP=2 x DP=2": (4, PP2_2BW),
}
RESHARD_RTOL = 1e-5


def _close(a, b, rtol):
    return len(a) == len(b) and all(abs(x - y) <= rtol * abs(y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def reshard_reference(tmp_path_factory):
    """A torch_dist 2bw PP=2 checkpoint at SAVED_AT, and its resume at PP=2 (the reference)."""
    root = tmp_path_factory.mktemp("reshard")
    ckpt, first = _first_half(root, 2, RESHARD + PP2_2BW)
    same = _resumed_losses(root, 2, RESHARD + PP2_2BW, _copy(ckpt, root / "same"), first, "same")
    return ckpt, first, same


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_torch_dist_stash_reshards_to_another_layout(tmp_path, layout, reshard_reference):
    ckpt, first, same = reshard_reference
    nproc, flags = LAYOUTS[layout]
    other = _resumed_losses(tmp_path, nproc, RESHARD + flags, _copy(ckpt, tmp_path / "other"), first, "other")
    assert _close(other, same, RESHARD_RTOL), (other, same)
    if layout == "PP=4":  # negative control (once: 4-process runs are slow on 2 cores)
        bare = _copy(ckpt, tmp_path / "bare")
        (bare / f"iter_{SAVED_AT:07d}" / "megatron_async.json").unlink()  # resumes without the stash
        without = _resumed_losses(tmp_path, nproc, RESHARD + flags, bare, first, "without", module=OLD_ENTRY,
                                  env=MARKERLESS_RESUME)
        assert not _close(without, same, RESHARD_RTOL), "a resume without the stash must differ"


def test_per_rank_state_at_another_layout_is_refused_naming_it(tmp_path):
    flags = RESHARD + PP2_2BW + ["--delay-correction", "ef"]
    ckpt, _ = _first_half(tmp_path, 2, flags)
    line = _refusal(tmp_path, "pp4", 4, RESHARD + ["--pipeline-model-parallel-size", "4", "--pipeline-schedule",
                                                   "2bw", "--delay-correction", "ef", "--load", str(ckpt)])
    assert "the delay-correction state" in line and "PP=2" in line and "PP=4" in line, line
    assert "the weight stash" not in line, line  # the stash itself reshards

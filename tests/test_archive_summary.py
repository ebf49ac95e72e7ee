"""Summaries rebuilt from archived runs (bench/delay/archive_summary.py), and the length
table of docs/reproduction.md checked against the runs kept in bench/archive."""

import json
from pathlib import Path

from bench.delay import archive_summary, delay_length
from bench.delay.sweep_runner import run_name

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = ("shakespeare_150", "shakespeare_600", "shakespeare_2400")


def _archive(tmp_path, losses: dict) -> Path:
    for (opt, lr, mode, seed), loss in losses.items():
        command = "--standalone -m megatron_async.launch --train-iters 600 --global-batch-size 16 --seq-length 128"
        (tmp_path / f"{run_name(opt, lr, mode, seed)}.json").write_text(json.dumps(
            dict(optimizer=opt, lr=lr, mode=mode, seed=seed, final_val_loss=loss, command=command)))
    return tmp_path


def test_each_rate_is_summarised_over_the_seeds_that_have_both_a_sync_and_a_delayed_run(tmp_path):
    runs = {("muon", 0.016, m, s): 4.0 + (m != "sync") * 0.2 + s * 0.01 for m in ("sync", "async") for s in (0, 1)}
    runs[("muon", 0.016, "async+ef", 0)] = 4.1  # EF has seed 0 only: no EF column for the 2-seed cell
    runs.update({("muon", 0.008, "sync", 0): 3.9, ("muon", 0.008, "async", 0): 4.0, ("muon", 0.008, "sync", 1): 3.8,
                 ("adam", 0.001, "sync", 0): 5.0})  # a sync-only rate has no gap and no row
    out = archive_summary.summaries(_archive(tmp_path, runs))
    got = {(s["table"][o]["best_lr"], tuple(s["seeds"]), tuple(k for k in s["table"][o] if "async" in k or k == "sync"))
           for s in out for o in s["table"]}
    assert got == {(0.008, (0,), ("sync", "async")), (0.016, (0, 1), ("sync", "async"))}
    assert all(s["model"] == {"iters": 600, "global_batch_size": 16, "seq_length": 128} for s in out)


def test_a_rate_tried_in_sync_alone_is_reported_against_the_tuned_row(tmp_path):
    """A re-tuning check with no delayed run has no row; the report says whether it beat
    the bold rate, on the seeds both have, so a better untried rate cannot hide."""
    for checked_loss, verdict in ((4.2, "higher, so the bold rate stays."), (3.9, "lower, so the bold rate is not")):
        archive = tmp_path / str(checked_loss)
        archive.mkdir()
        runs = {("muon", 0.008, "sync", 0): 4.0, ("muon", 0.008, "async", 0): 4.1, ("muon", 0.008, "sync", 1): 3.5,
                ("muon", 0.008, "async", 1): 3.6, ("muon", 0.004, "sync", 0): checked_loss}
        assert archive_summary.sync_only(_archive(archive, runs)) == [
            dict(optimizer="muon", lr=0.004, iters=600, sync_by_seed={0: checked_loss})]
        result = delay_length.main(["--archive", str(archive)])
        (check,) = result["sync_checks"]
        assert (check["seeds"], check["tuned_sync"], check["lower"]) == ([0], 4.0, checked_loss < 4.0)
        line = next(x for x in delay_length.report(result["rows"], {}, [check]).splitlines() if "Sync only" in x)
        assert f"lr 0.004: {checked_loss:.4f} against 4.0000 at 0.008 (seed 0): {verdict}" in line


def test_the_length_table_in_the_docs_is_what_the_archived_runs_give():
    """Every row and the targets line of the length table in docs/reproduction.md are
    what bench.delay.delay_length prints for bench/archive; a run added to the archive
    without the doc being rebuilt fails here."""
    argv = [a for name in LENGTHS for a in ("--archive", str(ROOT / "bench" / "archive" / name))]
    result = delay_length.main(argv)
    text = delay_length.report(result["rows"], result["targets"], result["sync_checks"])
    doc = (ROOT / "docs" / "reproduction.md").read_text()
    lines = [line for line in text.splitlines() if line.startswith(("| adam", "| muon", "Targets at", "- Sync only"))]
    assert len(lines) >= 7
    missing = [line for line in lines if line not in doc]
    assert not missing, "docs/reproduction.md lacks, or has other numbers than:\n" + "\n".join(missing)

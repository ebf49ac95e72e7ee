"""bench/delay/delay_studies.py: the MoE, momentum and size reports rebuilt from archived runs,
and docs/reproduction.md's tables for them checked against bench/archive."""

import json
import math
from pathlib import Path

import pytest

from bench.delay import delay_studies
from bench.delay.sweep_runner import PRESETS, Model, run_name

ROOT = Path(__file__).resolve().parents[1]


def _write(archive: Path, model: Model, opt, lr, mode, seed, loss, momentum=None, routing=None):
    flags = model.flags() + ["--optimizer", opt, "--lr", f"{lr:g}"]
    if momentum is not None:
        flags += ["--muon-momentum", f"{momentum:g}"]
    suffix = f"_m{momentum:g}" if momentum is not None else ""
    run = dict(optimizer=opt, lr=lr, mode=mode, seed=seed, final_val_loss=loss,
               command=" ".join(["-m", "megatron_async.launch", "--gpt", *flags]))
    if routing is not None:
        run["routing"] = routing
    archive.mkdir(parents=True, exist_ok=True)
    (archive / f"{run_name(opt, lr, mode, seed, suffix)}.json").write_text(json.dumps(run))


def _routing(level, layers=4):
    its = [50 * (i + 1) for i in range(5)]
    imb = [level + 0.1 * i for i in range(5)]
    return dict(iterations=its, aux_loss=[1.0 + 0.01 * i for i in range(5)], load_imbalance=imb,
                load_imbalance_layers=[[x + 0.05 * k for k in range(layers)] for x in imb])


def _study(tmp_path, muon_gap=0.05, adam_gap=0.3):
    dense, moe = Model(iters=600), Model(iters=600, **PRESETS["moe"])
    for archive, model in ((tmp_path / "dense", dense), (tmp_path / "moe", moe)):
        for seed in (0, 1):
            for opt, lr, sync, gap in (("adam", 0.002, 4.7, adam_gap), ("muon", 0.008, 4.3, muon_gap)):
                routing = (lambda level: _routing(level)) if model.num_experts else (lambda level: None)
                _write(archive, model, opt, lr, "sync", seed, sync + 0.01 * seed, routing=routing(1.2 + seed * 0.01))
                _write(archive, model, opt, lr, "async", seed, sync + gap + 0.02 * seed, routing=routing(1.3))
                _write(archive, model, opt, lr, "async+ef", seed, sync + gap / 2, routing=routing(1.25))
            _write(archive, model, "muon", 0.016, "sync", seed, 4.4)  # a worse rate: not the tuned one
            _write(archive, model, "muon", 0.016, "async", seed, 4.41)
    return tmp_path / "dense", tmp_path / "moe"


def test_moe_report_puts_models_side_by_side_with_per_seed_gaps(tmp_path):
    dense, moe = _study(tmp_path)
    rows = delay_studies.main(["moe", "--dense", str(dense), "--moe", str(moe), "--plot", str(tmp_path / "r.png")])
    rows = rows["rows"]
    assert {(r["model"], r["optimizer"], r["lr"]) for r in rows} == {
        ("4L/128H", "adam", 0.002), ("4L/128H", "muon", 0.008),
        ("4L/128H, 8 experts top-2", "adam", 0.002), ("4L/128H, 8 experts top-2", "muon", 0.008)}
    muon = next(r for r in rows if r["optimizer"] == "muon" and "experts" in r["model"])
    expected = [(4.35 - 4.3) / 4.3, (4.3 + 0.05 + 0.02 - 4.31) / 4.31]
    assert muon["relative_gap_by_seed"] == pytest.approx(expected)
    assert muon["parameters"] == Model(**PRESETS["moe"]).parameters()
    assert muon["recovered"]["EF"] == pytest.approx((4.36 - 4.325) / (4.36 - 4.305))
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("muon_gap, adam_gap, verdict", [(0.05, 0.3, ("met", "met")),
                                                        (0.1, 0.2, ("not met", "not met"))])
def test_moe_targets_say_met_or_not(tmp_path, muon_gap, adam_gap, verdict):
    dense, moe = _study(tmp_path, muon_gap, adam_gap)
    rows = delay_studies.tuned_rows(dense) + delay_studies.tuned_rows(moe)
    line = delay_studies.moe_targets(rows)
    assert f"(target < 2%: {verdict[0]})" in line and f"(target >= 3x: {verdict[1]})" in line
    assert line.startswith("MoE targets at 600 steps, 2 seeds:"), line
    for r in rows:  # AdamW with one seed so far: the line names each optimizer's seeds
        r["seeds"] = 1 if r["optimizer"] == "adam" else r["seeds"]
    line = delay_studies.moe_targets(rows)
    assert line.startswith("MoE targets at 600 steps, Muon 2 seeds, AdamW 1 seed:"), line


def test_routing_table_reads_first_middle_last_windows_and_each_seed(tmp_path):
    dense, moe = _study(tmp_path)
    table = delay_studies.routing_table(delay_studies.tuned_rows(moe))
    sync = next(line for line in table.splitlines() if line.startswith("| muon | sync |"))
    # windows 0, 2, 4 of the mean over seeds 1.20 and 1.21; worst layer: +0.15
    assert "| 1.205 / 1.405 / 1.605 | 1.405 |" in sync and "| 1.755 |" in sync and "| 1.600, 1.610 |" in sync
    assert "| 1.000 / 1.020 / 1.040 |" in sync


def test_momentum_rows_group_by_the_momentum_each_command_ran(tmp_path):
    archive = tmp_path / "m"
    model = Model(iters=600)
    for seed in (0, 1):
        _write(archive, model, "muon", 0.008, "sync", seed, 4.3)  # the default momentum (0.95)
        _write(archive, model, "muon", 0.008, "async", seed, 4.4)
        for momentum, gap in ((0.9, 0.2), (0.98, 0.05)):
            _write(archive, model, "muon", 0.008, "sync", seed, 4.3, momentum)
            _write(archive, model, "muon", 0.008, "async", seed, 4.3 + gap, momentum)
    rows = delay_studies.main(["momentum", "--archive", str(archive)])["rows"]
    assert [r["momentum"] for r in rows] == [0.9, 0.95, 0.98]
    assert [r["gap"] for r in rows] == pytest.approx([0.2, 0.1, 0.05])
    assert all(r["seeds"] == [0, 1] for r in rows)


def test_size_rows_order_models_by_parameters(tmp_path):
    for name in ("dense", "dense-large"):
        model = Model(iters=600, **PRESETS[name])
        for seed in (0, 1):
            _write(tmp_path / name, model, "muon", 0.008, "sync", seed, 4.3)
            _write(tmp_path / name, model, "muon", 0.008, "async", seed, 4.4 if name == "dense" else 4.35)
    result = delay_studies.main(["size", "--archive", str(tmp_path / "dense"), "--archive",
                                 str(tmp_path / "dense-large"), "--plot", str(tmp_path / "s.png")])
    small, large = sorted(result["rows"], key=lambda r: r["parameters"])
    assert large["parameters"] >= 4 * small["parameters"]
    assert large["relative_gap"] < small["relative_gap"]
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"


def test_missing_runs_names_what_a_study_still_lacks(tmp_path):
    """A sweep in progress (its rate search only, then one delayed run) lacks the tuned
    rate's other runs, and a complete archive lacks none: the docs check waits for it."""
    model = Model(iters=600, **PRESETS["dense-large"])
    for lr, loss in ((0.001, 4.8), (0.002, 4.7)):
        _write(tmp_path, model, "adam", lr, "sync", 0, loss)
    _write(tmp_path, model, "muon", 0.004, "sync", 0, 4.5)
    assert delay_studies.missing_runs(tmp_path / "empty") == ["adam: no sync run on seed 0",
                                                             "muon: no sync run on seed 0"]
    lacking = delay_studies.missing_runs(tmp_path)
    assert len(lacking) == 10 and "adam lr 0.002 async seed 0" in lacking and "muon lr 0.004 sync seed 1" in lacking
    assert not any("adam lr 0.001" in m for m in lacking)  # the rate the search did not pick
    _write(tmp_path, model, "adam", 0.002, "async", 0, 4.9)
    assert len(delay_studies.missing_runs(tmp_path)) == 9
    for opt, lr in (("adam", 0.002), ("muon", 0.004)):
        for mode in ("sync", "async", "async+ef"):
            for seed in (0, 1):
                _write(tmp_path, model, opt, lr, mode, seed, 4.6)
    assert delay_studies.missing_runs(tmp_path) == []
    result = delay_studies.main(["size", "--archive", str(tmp_path)])
    assert result["missing"] == {str(tmp_path): []} and len(result["rows"]) == 2


ALL_MODES = ("sync", "async", "async+ef")
DOC_STUDIES = {  # report argv -> the archives it needs and their modes (a study whose runs are not all in is not checked yet)
    "moe": (["moe", "--dense", "bench/archive/shakespeare_600", "--dense", "bench/archive/shakespeare_600_fp32ns",
             "--moe", "bench/archive/shakespeare_moe_600"],
            ["shakespeare_600", "shakespeare_moe_600"], ALL_MODES),
    "moe_2400": (["moe", "--dense", "bench/archive/shakespeare_2400", "--dense", "bench/archive/shakespeare_2400_fp32ns",
                  "--moe", "bench/archive/shakespeare_moe_2400"], ["shakespeare_2400", "shakespeare_moe_2400"], ALL_MODES),
    "momentum": (["momentum", "--archive", "bench/archive/shakespeare_600_fp32ns"], ["shakespeare_600_fp32ns"],
                 ("sync", "async")),
    "momentum_2400": (["momentum", "--archive", "bench/archive/shakespeare_2400_fp32ns"],
                      ["shakespeare_2400_fp32ns"], ("sync", "async")),
    "size": (["size", "--archive", "bench/archive/shakespeare_600", "--archive", "bench/archive/shakespeare_600_fp32ns",
              "--archive", "bench/archive/shakespeare_large_600"], ["shakespeare_large_600"], ALL_MODES),
}


def shown_table(doc: str, study: str) -> bool:
    """Whether the doc shows a table between the study's report markers: a partial table
    shown there (some runs still missing) is checked like a complete one."""
    start = f"<!-- bench.delay.delay_studies {study} -->"
    if start not in doc:
        return False
    block = doc.split(start, 1)[1].split("<!-- end -->", 1)[0]
    return any(line.startswith("| ") for line in block.splitlines())


def test_a_partial_table_in_the_docs_is_checked():
    doc = "x\n<!-- bench.delay.delay_studies size -->\n<!-- end -->\n| a | b |\n"
    assert not shown_table(doc, "size") and not shown_table(doc, "moe")
    assert shown_table(doc.replace("size -->\n", "size -->\n| model |\n"), "size")


@pytest.mark.parametrize("study", list(DOC_STUDIES))
def test_the_studies_tables_in_the_docs_are_what_the_archived_runs_give(study, monkeypatch):
    argv, needed, modes = DOC_STUDIES[study]
    report = argv[0]
    optimizers = ("muon",) if report == "momentum" else ("adam", "muon")
    if not all((ROOT / "bench" / "archive" / n).is_dir() for n in needed):
        pytest.skip(f"{study}: archive {needed} not in the repository yet")
    missing = [m for n in needed for m in delay_studies.missing_runs(ROOT / "bench" / "archive" / n, modes=modes,
                                                                     optimizers=optimizers)]
    doc = (ROOT / "docs" / "reproduction.md").read_text()
    if missing and not shown_table(doc, study):  # a sweep that spans sessions archives run by run
        pytest.skip(f"{study}: {len(missing)} runs not archived yet: {'; '.join(missing)}")
    monkeypatch.chdir(ROOT)
    result = delay_studies.main(argv)
    rows = result["rows"]
    if report == "moe":
        text = "\n".join([delay_studies.gap_table(rows), delay_studies.moe_targets(rows),
                          delay_studies.routing_table(rows)])
    elif report == "momentum":
        text = delay_studies.momentum_table(rows)
    else:
        text = delay_studies.gap_table(rows)
    lines = [line for line in text.splitlines()
             if line.startswith("| ") and not line.startswith(("| model", "| optimizer", "| --")) or
             line.startswith("MoE targets")]
    assert lines and all(math.isfinite(r.get("relative_gap", 0)) for r in rows)
    missing = [line for line in lines if line not in doc]
    assert not missing, "docs/reproduction.md lacks, or has other numbers than:\n" + "\n".join(missing)

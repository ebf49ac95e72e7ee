"""bench/delay/delay_sweep.py keeps working: --quick runs, summarises, plots and resumes."""

import json
import math

import pytest


@pytest.fixture(autouse=True)
def warm_benchmark_ranks(monkeypatch):
    """The sweep's jobs on warm ranks (tests/support/launch.py's start_torchrun):
    these tests check what the sweep runs, records and resumes, not how fast."""
    from tests.support.launch import BENCH_WARM_ENV

    monkeypatch.setenv(BENCH_WARM_ENV, "1")


def _sweep(capsys, out, data, *extra):
    """The sweep's main in this process, so its jobs fork from this worker's warm ranks;
    what it printed."""
    from bench.delay import delay_sweep

    capsys.readouterr()
    assert delay_sweep.main(["--quick", "--out", str(out), "--data", str(data), *extra]) == 0
    return capsys.readouterr().out


def test_quick_sweep_summarises_and_resumes(small_corpus, tmp_path, capsys):
    out = tmp_path / "sweep"
    first = _sweep(capsys, out, small_corpus, "--muon-nesterov-sync", "--optimizers", "muon")  # adam: test_a_run_cut_short
    summary = json.loads((out / "summary.json").read_text())
    # the look-ahead's sync baseline: Muon with Megatron's Nesterov momentum
    nesterov_run = json.loads((out / "runs" / "muon_lr0.002_sync_s0_nesterov" / "result.json").read_text())
    assert "--muon-nesterov" in nesterov_run["command"].split()
    assert summary["muon_nesterov_sync"]["runs"] == [nesterov_run["final_val_loss"]]
    assert "sync, --muon-nesterov" in (out / "table.md").read_text()
    assert set(summary["table"]) == {"muon"}
    for opt, row in summary["table"].items():
        for mode in ("sync", "async"):
            assert all(math.isfinite(v) for v in row[mode]["runs"]), (opt, mode, row)
        assert row["gap"] == row["async"]["mean"] - row["sync"]["mean"]
        # each run trained: its training loss fell (each of Megatron's evaluations reads
        # the next validation batches, so a few of them are too noisy to compare)
        for name, seconds in summary["run_seconds"].items():
            losses = [loss for _, loss in json.loads((out / "runs" / name / "result.json").read_text())["train_curve"]]
            assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5, (name, losses)
    table = (out / "table.md").read_text()
    assert "| muon |" in table and "| adam |" not in table
    assert (out / "reproduction_muon.png").read_bytes()[:4] == b"\x89PNG"
    assert first.count("skipped") == 0
    # a second invocation finds every run done and only rebuilds the summary; with
    # --archive the results are also kept outside the run directories
    archive = tmp_path / "archive"
    second = _sweep(capsys, out, small_corpus, "--archive", str(archive), "--muon-nesterov-sync", "--optimizers", "muon")
    assert second.count("skipped (done before)") == 3, second
    # the length report reads the summary
    from bench.delay import delay_length

    rows = delay_length.main([str(out / "summary.json")])["rows"]
    assert {r["optimizer"] for r in rows} == {"muon"} and all(r["iters"] == 20 for r in rows)


def test_archived_results_are_reused(tmp_path):
    """A run whose result is in the archive (kept in the repository) is not run again."""
    from bench.delay.sweep_runner import Model, Run, execute

    archive = tmp_path / "archive"
    archive.mkdir()
    kept = {"name": "adam_lr0.002_sync_s0", "final_val_loss": 4.5, "seconds": 1.0,
            "command": " ".join(["-m", "megatron_async.launch", "--gpt", *Model().flags()])}
    (archive / "adam_lr0.002_sync_s0.json").write_text(json.dumps(kept))
    result = execute(Run("adam_lr0.002_sync_s0", "adam", 0.002, "sync", 0), Model(), tmp_path / "no-data",
                     tmp_path / "out", 10.0, archive)
    assert result["skipped"] and result["final_val_loss"] == 4.5


def test_quick_with_neither_adam_nor_muon_names_the_flag(capsys):
    """--quick runs AdamW's and Muon's runs only: asked for others alone it refuses
    rather than run two optimizers nobody asked for."""
    from bench.delay.delay_sweep import parse

    assert parse(["--quick", "--optimizers", "muon,lion"]).quick
    with pytest.raises(SystemExit):
        parse(["--quick", "--optimizers", "lion"])
    assert "--optimizers lion" in capsys.readouterr().err


def test_fixed_lr_parses_and_bad_values_name_the_flag(capsys):
    import pytest

    from bench.delay.delay_sweep import parse

    assert parse(["--lr", "adam=0.002,muon=8e-3"]).fixed_lr == {"adam": 0.002, "muon": 0.008}
    assert parse([]).fixed_lr == {}
    for bad in ("adam=x", "adam", "foo=0.1", "adam=1=2"):
        with pytest.raises(SystemExit):
            parse(["--lr", bad])
        assert "--lr" in capsys.readouterr().err, bad


def test_lr_grid_narrows_the_search_and_bad_values_name_the_flag(capsys):
    """--lr-grid re-tunes around a rate: only the rates given are searched."""
    from bench.delay.delay_sweep import parse

    assert parse(["--lr-grid", "adam=0.002:1e-3,muon=0.008"]).lr_grid == {"adam": [0.001, 0.002], "muon": [0.008]}
    assert parse([]).lr_grid == {}
    for bad in (["--lr-grid", "adam=x"], ["--lr-grid", "adam"], ["--lr-grid", "foo=0.1"],
                ["--lr-grid", "adam=0.001:0.002", "--lr", "adam=0.002"]):
        with pytest.raises(SystemExit):
            parse(bad)
        assert "--lr-grid" in capsys.readouterr().err, bad


def _summary(iters, opt, lr, sync, async_, ef):
    runs = lambda v: {"mean": v, "runs": [v, v]}
    return {"model": {"iters": iters, "global_batch_size": 16, "seq_length": 128},
            "table": {opt: {"best_lr": lr, "sync": runs(sync), "async": runs(async_), "async+ef": runs(ef),
                            "gap": async_ - sync, "recovered": {"async+ef": (async_ - ef) / (async_ - sync)}}}}


def test_length_report_picks_each_lengths_rate_by_sync_loss_alone(tmp_path):
    """Re-tuning per length: of two Muon rates at one length, the targets read the one
    with the lower sync loss, whichever has the smaller gap."""
    from bench.delay import delay_length

    adam = _summary(2400, "adam", 0.002, 4.2, 4.8, 4.3)
    for low_sync_lr in (0.016, 0.008):
        muon = [_summary(2400, "muon", lr, 4.00 if lr == low_sync_lr else 4.05, 4.2 if lr == 0.016 else 4.1, 4.1)
                for lr in (0.016, 0.008)]
        paths = []
        for i, s in enumerate([adam, *muon]):
            paths.append(tmp_path / f"s{i}.json")
            paths[-1].write_text(json.dumps(s))
        result = delay_length.main([str(p) for p in paths])
        muon_rows = [r for r in result["rows"] if r["optimizer"] == "muon"]
        assert len(muon_rows) == 2 and sum(r["tuned"] for r in muon_rows) == 1
        chosen = next(r for r in muon_rows if r["tuned"])
        assert chosen["lr"] == low_sync_lr == result["targets"]["muon_lr"]
        adam_row = next(r for r in result["rows"] if r["optimizer"] == "adam")
        assert result["targets"]["adam_over_muon_gap"] == adam_row["gap"] / chosen["gap"]


def test_length_report_compares_rates_on_the_seeds_they_share(tmp_path):
    """A rate whose second seed has not finished is judged on seed 0 against the
    others' seed 0, not against their two-seed mean (which seed 1 may pull down)."""
    from bench.delay import delay_length

    def summary(lr, sync_runs):
        s = _summary(2400, "muon", lr, sum(sync_runs) / len(sync_runs), 4.2, 4.1)
        s["seeds"] = list(range(len(sync_runs)))
        s["table"]["muon"]["sync"]["runs"] = sync_runs
        return s

    two_seeds, one_seed = summary(0.016, [4.05, 3.95]), summary(0.008, [4.04])  # means 4.00 and 4.04
    paths = []
    for i, s in enumerate([two_seeds, one_seed]):
        paths.append(tmp_path / f"s{i}.json")
        paths[-1].write_text(json.dumps(s))
    rows = delay_length.main([str(p) for p in paths])["rows"]
    assert [(r["lr"], r["tuned"], r["tuned_on_seeds"]) for r in rows] == [(0.008, True, [0]), (0.016, False, [0])]
    assert "| 0.008 |" not in delay_length.report(rows, {}) and "| **0.008** | 1 |" in delay_length.report(rows, {})


def test_the_targets_give_each_seeds_own_recovery(tmp_path):
    """EF's share of a small gap varies by seed: the targets line gives each seed's
    share next to the share of the mean gap."""
    from bench.delay import delay_length

    adam, muon = _summary(2400, "adam", 0.002, 4.2, 4.8, 4.3), _summary(2400, "muon", 0.008, 4.0, 4.1, 4.05)
    muon["table"]["muon"]["sync"]["runs"] = [4.0, 4.0]
    muon["table"]["muon"]["async"]["runs"] = [4.1, 4.1]
    muon["table"]["muon"]["async+ef"]["runs"] = [4.08, 4.02]  # 20% and 80% of each seed's gap, 50% of the mean
    paths = [tmp_path / "adam.json", tmp_path / "muon.json"]
    for path, s in zip(paths, (adam, muon)):
        path.write_text(json.dumps(s))
    result = delay_length.main([str(p) for p in paths])
    assert [round(v, 6) for v in result["targets"]["ef_recovers_muon_by_seed"]] == [0.2, 0.8]
    assert "(per seed: 20%, 80%; target >= 50%" in delay_length.report(result["rows"], result["targets"])


def test_a_run_cut_short_resumes_from_its_checkpoint(small_corpus, tmp_path):
    """--save-interval: a run stopped at a checkpoint (here by Megatron's --exit-interval,
    as a session's end would stop it) continues from there on the next invocation, and
    its metrics cover every step once."""
    from bench.delay.sweep_runner import Model, Run, execute

    model = Model(num_layers=2, hidden_size=64, seq_length=64, micro_batch_size=4, global_batch_size=8,
                  iters=20, eval_interval=10, eval_iters=2, save_interval=10)
    root, name = tmp_path / "out", "adam_lr0.002_async+ef_s0"
    cut = Run(name, "adam", 0.002, "async+ef", 0, extra=["--exit-interval", "10"])
    with pytest.raises(RuntimeError, match="stopped at iteration 10 of 20; its checkpoints are kept"):
        execute(cut, model, small_corpus, root, 600.0)
    run_dir = root / "runs" / name
    assert not (run_dir / "result.json").exists()
    first = [json.loads(line) for line in open(run_dir / "metrics.jsonl", encoding="utf-8")]
    first = [(r["iteration"], r["lm_loss"]) for r in first if r.get("lm_loss") is not None]
    assert [i for i, _ in first] == list(range(1, 11))
    assert (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "10"
    done = execute(Run(name, "adam", 0.002, "async+ef", 0), model, small_corpus, root, 600.0)
    assert done["resumed"] and "--load" in done["command"]
    assert "at iteration 10" in (run_dir / "train.log").read_text()  # Megatron loaded it, not a fresh start
    assert [i for i, _ in done["train_curve"]] == list(range(1, 21))
    assert [tuple(p) for p in done["train_curve"][:10]] == first
    assert not (run_dir / "checkpoints").exists()


def test_an_archived_run_of_another_model_or_recipe_is_not_reused(tmp_path):
    """Runs are archived by name only (optimizer, lr, mode, seed): a run of another
    network, or with another Newton-Schulz precision, must not stand in for this one."""
    from bench.delay.sweep_runner import PRESETS, Model, Run, execute

    dense = Model()
    archive = tmp_path / "archive"
    archive.mkdir()
    command = " ".join(["-m", "megatron_async.launch", "--gpt", *dense.flags()])
    (archive / "adam_lr0.002_sync_s0.json").write_text(json.dumps({"final_val_loss": 4.5, "command": command}))
    run = Run("adam_lr0.002_sync_s0", "adam", 0.002, "sync", 0)
    for other, flag in ((Model(**PRESETS["moe"]), "--num-experts"), (Model(**PRESETS["dense-large"]), "--num-layers"),
                        (Model(muon_matmul_prec="high"), "--muon-fp32-matmul-prec")):
        with pytest.raises(RuntimeError, match=flag):
            execute(run, other, tmp_path / "no-data", tmp_path / "out", 10.0, archive)
    # control: the model that trained it reuses it
    assert execute(run, dense, tmp_path / "no-data", tmp_path / "out", 10.0, archive)["skipped"]


def test_presets_and_their_sizes():
    """dense-large has at least 4x the dense model's parameters; the MoE model has 8
    experts, top-2, each half the dense MLP's width (so about the dense active size)."""
    from bench.delay.sweep_runner import PRESETS, Model

    dense, large, moe = (Model(**PRESETS[k]) for k in ("dense", "dense-large", "moe"))
    assert large.parameters() >= 4 * dense.parameters()
    flags = moe.flags()
    value = dict(zip(flags, flags[1:]))
    assert value["--num-experts"] == "8" and value["--moe-router-topk"] == "2"
    assert value["--moe-aux-loss-coeff"] == "0.01" and value["--moe-router-load-balancing-type"] == "aux_loss"
    h = moe.hidden_size
    active_mlp = moe.moe_topk * 2 * h * moe.moe_ffn_hidden_size
    assert active_mlp == 2 * h * 4 * h  # the dense MLP: h -> 4h -> h
    assert "--num-experts" not in dense.flags() and "--muon-fp32-matmul-prec" not in dense.flags()


def test_quick_moe_sweep_keeps_routing_and_megatrons_parameter_count(small_corpus, tmp_path, capsys):
    import sentencepiece

    from bench.delay.sweep_runner import PRESETS, Model

    out = tmp_path / "moe"
    _sweep(capsys, out, small_corpus, "--model", "moe", "--muon-matmul-prec", "high", "--optimizers", "muon")
    run = json.loads((out / "runs" / "muon_lr0.002_async_s0" / "result.json").read_text())
    assert "--muon-fp32-matmul-prec high" in run["command"]
    routing = run["routing"]
    assert routing["iterations"] == [10, 20]  # means over each --eval-interval window
    assert all(1.0 <= x <= 4.0 for x in routing["load_imbalance"]) and all(a > 0 for a in routing["aux_loss"])
    assert all(len(layers) == 2 for layers in routing["load_imbalance_layers"])
    vocab = sentencepiece.SentencePieceProcessor(model_file=str(small_corpus / "tokenizer.model")).vocab_size()
    padded = -(-vocab // 128) * 128
    quick = Model(num_layers=2, hidden_size=64, seq_length=64, num_experts=PRESETS["moe"]["num_experts"],
                  moe_ffn_hidden_size=128)
    assert run["parameters"] == quick.parameters(padded)  # the formula the archive's older runs rely on
    sync = json.loads((out / "runs" / "muon_lr0.002_sync_s0" / "result.json").read_text())
    assert sync["routing"]["iterations"] == [10, 20]
    assert not (out / "runs" / "adam_lr0.002_sync_s0").exists()  # --optimizers muon: Muon's runs only

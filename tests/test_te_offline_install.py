"""Transformer Engine installed from checked pieces on a GPU node without a package index
(docker/te_offline/), checked on the CPU.

docker/te_offline/pieces.py cuts files into pieces of a size one transfer can carry, and on the
node rebuilds them only when every piece is present and every checksum agrees. Here: a few MiB
of random files cut with a small limit come back byte for byte; a flipped byte, a missing piece,
a piece of another bundle and a manifest that disagrees with itself are refused, naming what to
do; the whole-file check catches an alteration the per-piece check was made blind to (negative
control of the second line of defence); docker/te_offline/te_node_setup.sh stops at the join
with exit 2 when a piece is missing; and the setup report (docker/te_offline/te_setup_report.py)
is written, read back and refused when malformed.
"""

import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TE_OFFLINE = REPO / "docker" / "te_offline"


def _load(name: str):
    """A script of docker/te_offline as a module of its own name (the folder is no package)."""
    spec = importlib.util.spec_from_file_location(f"te_offline_{name}", TE_OFFLINE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pieces = _load("pieces")
te_setup_report = _load("te_setup_report")
MIB, PiecesError = pieces.MIB, pieces.PiecesError


@pytest.fixture
def bundle(tmp_path):
    """Three files (3.5 MiB, 1 byte, 0.7 MiB) cut into pieces of at most 1 MiB."""
    src = tmp_path / "src"
    src.mkdir()
    rng = random.Random(59)
    sizes = {"big.whl": 3 * MIB + MIB // 2, "tiny.txt": 1, "mid.tar.gz": 7 * MIB // 10}
    for name, size in sizes.items():
        (src / name).write_bytes(rng.randbytes(size))
    files = [src / name for name in sizes]
    manifest = pieces.split(files, tmp_path / "pieces", MIB)
    return files, manifest, tmp_path


def _receive_all(folders, store, skip=()):
    for folder in sorted(folders.iterdir()):
        if folder.is_dir() and int(folder.name) not in skip:
            pieces.receive(folder, store)


def test_split_and_join_give_back_every_file(bundle):
    files, manifest, tmp = bundle
    assert len(manifest["pieces"]) == 5  # 4.2 MiB in pieces of 1 MiB
    assert all(p["size"] <= MIB for p in manifest["pieces"])
    for k in range(1, 6):
        carried = sorted(f.name for f in (tmp / "pieces" / str(k)).iterdir())
        assert carried == sorted([pieces.MANIFEST, manifest["pieces"][k - 1]["name"]])
    _receive_all(tmp / "pieces", tmp / "store")
    pieces.join(tmp / "store", tmp / "out")
    for f in files:
        assert (tmp / "out" / f.name).read_bytes() == f.read_bytes()


def test_the_manifest_round_trips_and_a_self_contradicting_one_is_refused(bundle):
    _, manifest, tmp = bundle
    assert pieces.read_manifest(tmp / "pieces" / pieces.MANIFEST) == manifest
    assert pieces.read_manifest(tmp / "pieces" / "3" / pieces.MANIFEST) == manifest
    bad = dict(manifest, pieces=manifest["pieces"][:-1])
    pieces.write_manifest(bad, tmp / "bad.json")
    with pytest.raises(PiecesError, match="disagree"):
        pieces.read_manifest(tmp / "bad.json")
    pieces.write_manifest(dict(manifest, format="other/1"), tmp / "other.json")
    with pytest.raises(PiecesError, match="not a megatron-async-pieces/1 manifest"):
        pieces.read_manifest(tmp / "other.json")


def test_a_flipped_byte_is_refused_on_arrival_and_at_the_join(bundle):
    _, manifest, tmp = bundle
    name = manifest["pieces"][1]["name"]
    carried = tmp / "pieces" / "2" / name
    data = bytearray(carried.read_bytes())
    data[12345] ^= 0x01
    carried.write_bytes(bytes(data))
    with pytest.raises(PiecesError, match=f"{name} has sha256 .*receive piece folder 2 again"):
        pieces.receive(tmp / "pieces" / "2", tmp / "store")
    _receive_all(tmp / "pieces", tmp / "store", skip={2})
    (tmp / "store" / name).write_bytes(bytes(data))  # as if the copy were altered after arrival
    with pytest.raises(PiecesError, match=f"{name} has sha256 .*receive piece folder 2 again"):
        pieces.join(tmp / "store", tmp / "out")
    assert not (tmp / "out").exists()


def test_a_missing_piece_is_refused_naming_its_folder(bundle):
    _, manifest, tmp = bundle
    _receive_all(tmp / "pieces", tmp / "store", skip={4})
    assert pieces.present(manifest, tmp / "store") == [1, 2, 3, 5]
    with pytest.raises(PiecesError, match=f"missing pieces {manifest['pieces'][3]['name']} .*receive piece folders 4 first"):
        pieces.join(tmp / "store", tmp / "out")


def test_the_whole_file_check_catches_what_the_piece_check_was_blinded_to(bundle):
    """Negative control: a piece altered together with its manifest entry passes the piece
    check, so only the rebuilt files' and the bundle's sha256 can stop it."""
    _, manifest, tmp = bundle
    _receive_all(tmp / "pieces", tmp / "store")
    store_piece = tmp / "store" / manifest["pieces"][0]["name"]
    data = bytearray(store_piece.read_bytes())
    data[0] ^= 0xFF
    store_piece.write_bytes(bytes(data))
    forged = json.loads((tmp / "store" / pieces.MANIFEST).read_text())
    forged["pieces"][0]["sha256"] = pieces.sha256_file(store_piece)
    pieces.write_manifest(forged, tmp / "store" / pieces.MANIFEST)
    with pytest.raises(PiecesError, match="big.whl rebuilt with sha256"):
        pieces.join(tmp / "store", tmp / "out")
    assert list((tmp / "out").iterdir()) == []


def test_pieces_of_two_bundles_do_not_mix(bundle, tmp_path):
    _, _, tmp = bundle
    pieces.receive(tmp / "pieces" / "1", tmp / "store")
    other_src = tmp_path / "other.bin"
    other_src.write_bytes(b"x" * 1000)
    pieces.split([other_src], tmp_path / "other_pieces", MIB)
    with pytest.raises(PiecesError, match="holds pieces of another bundle"):
        pieces.receive(tmp_path / "other_pieces" / "1", tmp / "store")


def test_split_refuses_to_clear_a_folder_it_did_not_write(tmp_path):
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "notes.txt").write_text("mine")
    src = tmp_path / "a.bin"
    src.write_bytes(b"a")
    with pytest.raises(PiecesError, match="holds no earlier split"):
        pieces.split([src], tmp_path / "keep", MIB)
    assert (tmp_path / "keep" / "notes.txt").read_text() == "mine"


def test_the_node_script_stops_at_the_join_when_a_piece_is_missing(bundle):
    """docker/te_offline/te_node_setup.sh as the node runs it, up to the join (no GPU needed)."""
    _, manifest, tmp = bundle
    env = dict(os.environ, OUT=str(tmp / "out_dir"), TE_STORE=str(tmp / "store"), SITE=str(tmp / "site"))
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"  # python3 = this Python, as on the node
    script = str(TE_OFFLINE / "te_node_setup.sh")
    for k in (1, 2, 3):
        done = subprocess.run(["bash", script, "receive", str(tmp / "pieces" / str(k))], cwd=tmp, env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
    done = subprocess.run(["bash", script, "setup", str(tmp / "pieces" / "5")], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "receive piece folders 4 first" in done.stderr
    phases = te_setup_report.read_phases(tmp / "store" / "phases.tsv")
    assert [(p["name"], p["rc"]) for p in phases] == [("receive 1", 0), ("receive 2", 0), ("receive 3", 0),
                                                       ("receive 5", 0), ("join", 2)]
    assert not (tmp / "site").exists()


def test_the_setup_report_is_written_read_and_refused_when_malformed(tmp_path):
    (tmp_path / "phases.tsv").write_text("receive 1\t0\t1.25\njoin\t0\t2.5\ninstall\t0\t9.75\nsmoke\t0\t20.5\n")
    smoke = {"ok": True, "stage": "done", "te": "2.20.2", "torch": "2.11.0+cu130", "torch_git": "70d99e998b49",
             "device": "GPU", "fp8_available": True, "fp8_vs_bf16": {"y": 0.03, "dx": 0.04, "dw": 0.05},
             "tolerance": 0.1}
    (tmp_path / "smoke.json").write_text(json.dumps(smoke))
    out = tmp_path / "te_setup.json"
    assert te_setup_report.main(["write", "--phases", str(tmp_path / "phases.tsv"), "--smoke",
                                 str(tmp_path / "smoke.json"), "--build", "carried", "--out", str(out)]) == 0
    report = te_setup_report.read_report(out)
    assert report["ok"] and report["setup_s"] == pytest.approx(1.25 + 2.5 + 9.75 + 20.5)
    lines = te_setup_report.summary(report)
    assert lines[:4] == ["receive 1: 1.2 s", "join: 2.5 s", "install: 9.8 s", "smoke: 20.5 s"]
    assert any("fp8 against bf16" in line and "dw 5.00e-02" in line for line in lines)
    assert "smoke: done; TE 2.20.2, torch 2.11.0+cu130, git 70d99e998b49, on GPU, fp8 True" in lines
    failed = te_setup_report.build_report(te_setup_report.read_phases(tmp_path / "phases.tsv"),
                                          dict(smoke, ok=False, stage="exception"), "node")
    assert failed["ok"] is False
    (tmp_path / "broken.tsv").write_text("join\t0\n")
    with pytest.raises(te_setup_report.ReportError, match="broken.tsv:1"):
        te_setup_report.read_phases(tmp_path / "broken.tsv")
    (tmp_path / "wrong.json").write_text(json.dumps(dict(report, phases=[{"name": "join"}])))
    with pytest.raises(te_setup_report.ReportError, match="phases must be"):
        te_setup_report.read_report(tmp_path / "wrong.json")
    (tmp_path / "foreign.json").write_text(json.dumps({"format": "x"}))
    with pytest.raises(te_setup_report.ReportError, match="is not a megatron-async-te-setup/1 report"):
        te_setup_report.read_report(tmp_path / "foreign.json")


def test_the_cli_says_what_is_wrong_and_exits_2(bundle, capsys):
    _, _, tmp = bundle
    assert pieces.main(["join", "--store", str(tmp / "nowhere"), "--dest", str(tmp / "out")]) == 2
    assert capsys.readouterr().err.startswith("pieces: error: no manifest at")

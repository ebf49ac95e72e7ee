"""prepare-data refuses input that would silently become garbage, and never leaves a mixed --out folder."""

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import module_text
from megatron_async.data import prepare
from megatron_async.data.cache import keyed_cache_path
from megatron_async.data.checks import check_training_data, count_tokens
from megatron_async.data.errors import DataError
from megatron_async.data.prepare import main


def _refused(argv, capsys) -> str:
    """The one error line of a refused prepare-data run."""
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("megatron-async-prepare-data: error: "), err
    return err[0]


def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _leftovers(out: Path) -> list:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", ""])
    proc.wait()
    return proc.pid


def test_binary_file_is_refused_naming_it(tmp_path, capsys):
    exe = tmp_path / "x.txt"
    shutil.copyfile(shutil.which("ls") or sys.executable, exe)  # the user trial's renamed /bin/ls
    err = _refused(["--input", str(exe), "--out", str(tmp_path / "out"), "--valid-fraction", "0"], capsys)
    assert str(exe) in err and "looks binary, not text" in err
    packed = tmp_path / "docs.jsonl"  # a gzipped .jsonl under the plain name
    packed.write_bytes(gzip.compress(b'{"text": "some words"}\n' * 50))
    err = _refused(["--input", str(packed), "--out", str(tmp_path / "out"), "--valid-fraction", "0"], capsys)
    assert str(packed) in err and "looks binary, not text" in err
    assert not (tmp_path / "out").exists() and not _leftovers(tmp_path / "out")


def _with_stray_byte(path: Path) -> int:
    """A UTF-8 file of accented text with one 0xFF byte in it; returns that byte's offset."""
    head = "Café, naïve, façade: " + module_text("textwrap")
    raw = head.encode("utf-8") + b"\xff" + "\nrésumé, déjà vu\n".encode("utf-8") + module_text("heapq").encode()
    path.write_bytes(raw)
    return len(head.encode("utf-8"))


def test_stray_byte_is_refused_with_file_and_offset(tmp_path, capsys):
    text = tmp_path / "notes.txt"
    offset = _with_stray_byte(text)
    err = _refused(["--input", str(text), "--out", str(tmp_path / "out"), "--valid-fraction", "0"], capsys)
    assert str(text) in err and f"0xFF at offset {offset}" in err and "--encoding" in err


def test_encoding_flag_decodes_as_told_and_is_recorded(tmp_path):
    text = tmp_path / "notes.txt"
    _with_stray_byte(text)
    stats = prepare(str(tmp_path / "out"), corpus=None, inputs=[str(text)], vocab_size=200, valid_fraction=0,
                    encoding="latin-1")
    assert stats["args"]["encoding"] == "iso8859-1"
    assert json.loads((tmp_path / "out" / "stats.json").read_text())["args"]["encoding"] == "iso8859-1"
    assert stats["splits"]["train"]["characters"] == text.stat().st_size  # Latin-1: one character per byte
    with pytest.raises(DataError, match="--encoding nonsense-42: unknown encoding"):
        prepare(str(tmp_path / "out2"), corpus=None, inputs=[str(text)], encoding="nonsense-42")


def test_repeated_run_without_validation_leaves_no_valid_split(tmp_path, text_files):
    out = tmp_path / "out"
    prepare(str(out), corpus=None, inputs=text_files, vocab_size=200, valid_fraction=0.2)
    assert (out / "valid_text_document.bin").is_file()
    stats = prepare(str(out), corpus=None, inputs=text_files, vocab_size=200, valid_fraction=0)
    assert list(stats["splits"]) == ["train"]
    assert sorted(p.name for p in out.iterdir()) == ["stats.json", "tokenizer.model", "tokenizer_metadata.json",
                                                     "train_text_document.bin", "train_text_document.idx"]
    assert not _leftovers(out)


def test_interrupted_run_leaves_previous_folder_intact(tmp_path, text_files, monkeypatch):
    out = tmp_path / "out"
    prepare(str(out), corpus=None, inputs=text_files, vocab_size=200, valid_fraction=0.2)
    before = _snapshot(out)
    staged = []

    def crash(prefix, *args, **kwargs):  # after the new tokenizer is written, before any dataset
        staged.append(Path(prefix).parent)
        assert (staged[0] / "tokenizer.model").is_file()
        raise RuntimeError("simulated crash")

    monkeypatch.setattr("megatron_async.data.indexed.write_indexed", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        prepare(str(out), corpus=None, inputs=text_files, vocab_size=300, valid_fraction=0.2)
    assert staged and staged[0].parent == out.parent and staged[0] != out  # it wrote aside, not into out
    assert _snapshot(out) == before and not _leftovers(out)
    monkeypatch.undo()

    stats = json.loads((out / "stats.json").read_text())
    assert stats["args"]["vocab_size"] == 200
    check_training_data([str(out / "train_text_document")], [str(out / "valid_text_document")],
                        str(out / "tokenizer.model"), seq_length=32, global_batch_size=8)
    for split, counts in stats["splits"].items():
        assert count_tokens(str(out / f"{split}_text_document")) == counts["tokens"]


def test_leftovers_of_killed_runs_are_cleaned_or_restored(tmp_path, text_files, capsys):
    out = tmp_path / "out"
    argv = ["--input", *text_files, "--out", str(out), "--vocab-size", "200"]
    assert main(argv) == 0
    before = _snapshot(out)
    dead, alive = _dead_pid(), os.getpid()
    # killed between retiring the old folder and moving the new one in: no `out` at all
    os.rename(out, tmp_path / f".out.old-{dead}-aaaa")
    (tmp_path / f".out.prepare-{dead}-bbbb").mkdir()
    (tmp_path / f".out.prepare-{dead}-bbbb" / "tokenizer.model").write_bytes(b"half written")
    (tmp_path / f".out.prepare-{alive}-cccc").mkdir()  # a live run's staging folder: not ours to delete
    capsys.readouterr()
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "restored" in printed and "nothing to do" in printed
    assert _snapshot(out) == before
    assert _leftovers(out) == [f".out.prepare-{alive}-cccc"]


def test_foreign_folder_is_refused_not_deleted(tmp_path, text_files, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("my own notes")
    (out / "tokenizer.model").write_bytes(b"")
    err = _refused(["--input", *text_files, "--out", str(out)], capsys)
    assert str(out) in err and "notes.txt" in err and "tokenizer.model" not in err
    assert (out / "notes.txt").read_text() == "my own notes"
    plain = tmp_path / "a_file"
    plain.write_text("x")
    assert "not a folder" in _refused(["--input", *text_files, "--out", str(plain)], capsys)


def _gpt_train_dataset(out: Path, cache):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    from megatron_async.data.tokenizer import load_tokenizer

    config = GPTDatasetConfig(
        random_seed=1, sequence_length=32, blend_per_split=[([str(out / "train_text_document")], None), None, None],
        tokenizer=load_tokenizer(out / "tokenizer.model"), reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, create_attention_mask=False, path_to_cache=cache, mid_level_dataset_surplus=0.005)
    return BlendedMegatronDatasetBuilder(GPTDataset, [16, 0, 0], lambda: True, config).build()[0]


def test_megatron_default_index_cache_goes_with_the_data(tmp_path, text_files):
    """GPTDataset caches under {prefix}/cache/ by default, keyed by path and settings only: a
    re-prepared folder must not keep it (the new data would reuse indices of the old)."""
    out = tmp_path / "out"
    prepare(str(out), corpus=None, inputs=text_files, vocab_size=200, valid_fraction=0.2)
    _gpt_train_dataset(out, cache=None)
    cache = out / "train_text_document" / "cache" / "GPTDataset_indices"
    assert any(p.suffix == ".npy" for p in cache.iterdir())
    prepare(str(out), corpus=None, inputs=text_files, vocab_size=300, valid_fraction=0.2)  # accepted: a cache
    assert not (out / "train_text_document").exists()
    assert len(_gpt_train_dataset(out, cache=None)) >= 16


def test_explicit_cache_path_is_keyed_by_the_data(tmp_path, text_files):
    out = tmp_path / "out"
    prefixes = [str(out / "train_text_document")]
    prepare(str(out), corpus=None, inputs=text_files, vocab_size=200, valid_fraction=0.2)
    first = keyed_cache_path(str(tmp_path / "cache"), prefixes)
    prepare(str(out), corpus=None, inputs=text_files, vocab_size=300, valid_fraction=0.2)
    assert keyed_cache_path(str(tmp_path / "cache"), prefixes) != first  # new data: a fresh cache
    prepare(str(out), corpus=None, inputs=text_files, vocab_size=200, valid_fraction=0.2)
    assert keyed_cache_path(str(tmp_path / "cache"), prefixes) == first  # same data again: reused
    assert keyed_cache_path(None, prefixes) is None

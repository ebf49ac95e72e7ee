"""Shared fixtures: a small real-English corpus, prepared once per test session; the ranks' forkserver ends with it."""

import inspect

import pytest

# Real English prose that every Python 3.12 ships: the documentation of stdlib modules.
STDLIB_MODULES = ["argparse", "collections", "textwrap", "json", "difflib", "heapq", "functools",
                  "shutil", "pathlib", "logging", "inspect", "subprocess"]


def module_text(name: str) -> str:
    """A module's docstring followed by those of its public functions and classes."""
    module = __import__(name)
    parts = [inspect.getdoc(module) or ""]
    for attr in sorted(vars(module)):
        obj = getattr(module, attr)
        if not attr.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj)):
            parts.append(f"{attr}\n{inspect.getdoc(obj) or ''}")
    return "\n\n".join(p for p in parts if p.strip())


# The modules that take longest, longest first (`make test PYTEST_ARGS=--durations=0`, summed per
# module): `make test` gives each of its two workers a whole module at a time in collection order,
# so long modules collected last leave one worker alone at the end. Only the order changes.
LONGEST_FIRST = ["test_cluster_files", "test_megatron_loop", "test_long_runs", "test_twin_matrix_across_ranks",
                 "test_twin_matrix", "test_checkpoint_formats", "test_checkpoint_guard", "test_bench_smoke",
                 "test_combined_steps_in_megatron_loop", "test_export_hf_moe", "test_muon", "test_patches",
                 "test_tied_embeddings", "test_refusals", "test_more_corrections", "test_two_bw",
                 "test_delay_correction"]


def pytest_collection_modifyitems(session, config, items):
    """LONGEST_FIRST's modules first, each module's tests in their own order."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))


def pytest_sessionfinish(session, exitstatus):
    """End the forkserver this pytest process started for its ranks (the quick run's, each
    xdist worker's): left to itself it outlives pytest by seconds, holding about 1 GB
    (tests/support/forkserver_stop.py). Runs after the session's fixtures are torn down."""
    from tests.support.forkserver_stop import stop_forkserver

    stop_forkserver()


@pytest.fixture(scope="session", autouse=True)
def mock_data_cache(tmp_path_factory):
    """One folder per pytest worker for the index of Megatron's mock dataset (built once
    per configuration instead of once per rank and run: tests/support/warm_launch.py); removed
    at the end, as the index of one configuration takes up to 150 MB."""
    import os
    import shutil

    from tests.support.warm_launch import MOCK_DATA_CACHE_ENV

    folder = tmp_path_factory.mktemp("mock_data_cache")
    os.environ[MOCK_DATA_CACHE_ENV] = str(folder)
    yield folder
    os.environ.pop(MOCK_DATA_CACHE_ENV, None)
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def text_files(tmp_path_factory):
    """One UTF-8 .txt file per stdlib module (about 100k characters in all); paths as strings."""
    root = tmp_path_factory.mktemp("text")
    files = []
    for name in STDLIB_MODULES:
        path = root / f"{name}.txt"
        path.write_text(module_text(name), encoding="utf-8")
        files.append(str(path))
    return files


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory, text_files):
    """A prepared data directory (tokenizer.model, {train,valid}_text_document, stats.json):
    one document per stdlib module, a 400-token BPE vocabulary, about a fifth held out."""
    from megatron_async.data import prepare

    out = tmp_path_factory.mktemp("small_corpus") / "prepared"
    prepare(str(out), corpus=None, inputs=text_files, vocab_size=400, valid_fraction=0.2, seed=1234)
    return out



@pytest.fixture
def tmpfs(tmp_path):
    """mount(name, options): a real tmpfs (root) under tmp_path, mounted with `options` (e.g.
    "size=1m", "ro,size=1m"), for the full and read-only file systems tests write to; unmounted
    after the test. Skips, saying why, where it cannot mount."""
    import subprocess

    mounted = []

    def mount(name: str, options: str):
        where = tmp_path / name
        where.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True,
                              text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {proc.stderr.strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)

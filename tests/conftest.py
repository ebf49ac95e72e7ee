"""Shared fixtures: a small real-English corpus, prepared once per test session."""

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


# The modules that take minutes of real multi-process training (fresh-clone `make test
# PYTEST_ARGS=--durations=30`), heaviest first. `make test` hands whole modules to its two
# workers in collection order (--dist loadscope --no-loadscope-reorder), so these start first
# and the two workers end together, instead of one worker running them alone at the end
# (xdist's own reorder starts the modules with the most tests first: the quick ones).
HEAVY_FIRST = ["test_megatron_loop.py", "test_save_lock.py", "test_stop_agreement.py", "test_bench_smoke.py",
               "test_checkpoint_formats.py", "test_long_runs.py", "test_delay_sweep.py", "test_refusals.py",
               "test_checkpoint_guard.py", "test_model_features.py", "test_variable_delay.py",
               "test_delay_correction.py", "test_real_corpus.py", "test_stash_start.py", "test_step_end_waits.py",
               "test_more_corrections.py", "test_moe_routing.py"]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each module keeps its order

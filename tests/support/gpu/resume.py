"""The GPU suite's resume check, shared by its 1- and 2-GPU forms: one run straight
through, one saved at `saved_at` and resumed, and the same checkpoint resumed without
its marker file (so without the stash and the EF state, through a test entry that lets
such a resume through): the negative control."""

from __future__ import annotations

import json
import shutil

from tests.support.gpu.compare import finite_losses, max_relative_difference
from tests.support.gpu.launch import DETERMINISTIC_ENV, read_metrics, tail, torchrun_gpt, train_losses


def _losses(tmp_path, base: list, nproc: int, timeout_s: float, name: str, extra: list,
            old_markerless: bool = False) -> list[float]:
    """`old_markerless`: through the test entry that resumes a checkpoint without its marker
    instead of refusing it (with both weight versions equal)."""
    metrics = tmp_path / f"{name}.jsonl"
    env = {**DETERMINISTIC_ENV, **({"MEGATRON_ASYNC_TEST_OLD_MARKERLESS_RESUME": "1"} if old_markerless else {})}
    module = "tests.support.step_end_entry" if old_markerless else "megatron_async.launch"
    proc = torchrun_gpt(base + extra + ["--metrics-json", metrics], nproc, timeout_s, env=env, module=module)
    assert proc.returncode == 0, f"{name}:\n{tail(proc)}"
    return train_losses(read_metrics(metrics))


def resume_against_uninterrupted(tmp_path, base: list, nproc: int, iters: int, saved_at: int,
                                 timeout_s: float) -> dict:
    """{full, resumed, without_marker}: each run's `iters` finite losses (the resumed ones
    after the first part's), and the largest relative differences from `full`."""
    from megatron_async.megatron_lm.checkpoint.marker import MARKER

    run = lambda name, extra, **kw: _losses(tmp_path, base, nproc, timeout_s, name, extra, **kw)  # noqa: E731
    full = finite_losses(run("full", []), iters)
    ckpt, bare = tmp_path / "ckpt", tmp_path / "ckpt_without_marker"
    first = run("first", ["--save", ckpt, "--save-interval", saved_at, "--exit-interval", saved_at])
    marker = ckpt / f"iter_{saved_at:07d}" / MARKER
    assert json.loads(marker.read_text())["weight_stash"], marker
    shutil.copytree(ckpt, bare)
    (bare / f"iter_{saved_at:07d}" / MARKER).unlink()
    resumed = finite_losses(first + run("resumed", ["--load", ckpt]), iters)
    without = finite_losses(first + run("without_marker", ["--load", bare], old_markerless=True), iters)
    return dict(full=full, resumed=resumed, without_marker=without,
                max_rel_difference=max_relative_difference(resumed, full),
                control_without_marker=max_relative_difference(without, full))

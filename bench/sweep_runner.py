"""Running many `megatron-async-pretrain` jobs for a benchmark sweep, resumably.

Each run is a subprocess (Megatron's own training loop with the plugin) with its own
directory OUT/runs/NAME; a finished run
leaves result.json there (final validation loss, curves, seconds, command) and is
skipped by the next invocation, so an interrupted sweep resumes where it stopped.
Runs go `parallel` at a time, one thread each, with a progress line per run.
Shared by bench/delay_sweep.py and bench/variable_delay.py.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent

# Muon runs with spectral scaling and an extra factor 0.2 (its update RMS matches
# AdamW's), so Muon and the Adam it uses for embeddings, output layer and 1-D
# parameters share one --lr on the AdamW scale.
MUON_MOMENTUM = "0.95"
OPTIMIZER_FLAGS = {
    "muon": ["--muon-momentum", MUON_MOMENTUM, "--muon-extra-scale-factor", "0.2"],
}
SEED_BASE = 1000  # run seed s trains with Megatron's --seed 1000 + s (Megatron refuses seeds <= 0)
MODES = {
    "sync": [],
    "async": ["--simulated-delay", "1"],
    "async+ef": ["--simulated-delay", "1", "--delay-correction", "ef"],
    "async+dc": ["--simulated-delay", "1", "--delay-correction", "dc-asgd"],
    "async+predict": ["--simulated-delay", "1", "--delay-correction", "predict"],
    "async+nesterov": ["--simulated-delay", "1", "--delay-correction", "nesterov"],
}
DEFAULT_MODES = ("sync", "async", "async+ef")


@dataclass
class Model:
    num_layers: int = 4
    hidden_size: int = 128
    heads: int = 4
    seq_length: int = 128
    micro_batch_size: int = 8
    global_batch_size: int = 16
    iters: int = 150
    eval_interval: int = 25
    eval_iters: int = 10
    save_interval: int = 0  # > 0: Megatron checkpoints every this many steps; an interrupted run resumes

    def flags(self) -> list[str]:
        return [
            "--num-layers", str(self.num_layers), "--hidden-size", str(self.hidden_size),
            "--num-attention-heads", str(self.heads), "--seq-length", str(self.seq_length),
            "--max-position-embeddings", str(self.seq_length),
            "--micro-batch-size", str(self.micro_batch_size), "--global-batch-size", str(self.global_batch_size),
            "--train-iters", str(self.iters), "--eval-interval", str(self.eval_interval),
            "--eval-iters", str(self.eval_iters), "--log-interval", str(self.eval_interval),
            "--untie-embeddings-and-output-weights", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--lr-decay-style", "cosine", "--lr-warmup-iters", str(max(1, self.iters // 10)),
            "--weight-decay", "0.1", "--clip-grad", "1.0",
            "--position-embedding-type", "learned_absolute", "--rerun-mode", "disabled", "--num-workers", "0",
        ]


@dataclass
class Run:
    name: str
    optimizer: str
    lr: float
    mode: str
    seed: int
    nproc: int = 1
    extra: list = field(default_factory=list)

    def args(self, model: Model, data: Path, out: Path) -> list[str]:
        return [
            *model.flags(), "--optimizer", self.optimizer, *OPTIMIZER_FLAGS.get(self.optimizer, []),
            "--lr", f"{self.lr:g}", "--min-lr", f"{self.lr / 10:g}", "--seed", str(SEED_BASE + self.seed),
            *MODES[self.mode], *self.extra,
            "--train-data-path", str(data / "train_text_document"),
            "--valid-data-path", str(data / "valid_text_document"),
            "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(data / "tokenizer.model"),
            "--data-cache-path", str(data / "cache"),
            "--metrics-json", str(out / "metrics.jsonl"),
        ]


def run_name(optimizer: str, lr: float, mode: str, seed: int, tag: str = "") -> str:
    return f"{optimizer}_lr{lr:g}_{mode}_s{seed}{tag}"


def _final_val_loss(records):
    """Megatron's evaluation after training, else the last one during training."""
    final = [r["final_val_loss"] for r in records if "final_val_loss" in r]
    return final[-1] if final else [r["val_loss"] for r in records if "val_loss" in r][-1]


def _die_with_parent() -> None:
    """Linux: the run gets SIGTERM when the sweep's thread that started it dies, so a
    killed sweep leaves no training job behind (torchrun passes it to its workers)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def execute(run: Run, model: Model, data: Path, root: Path, timeout_s: float, archive: Path | None = None) -> dict:
    """Run one training job unless its result.json exists (in the run directory, or as
    ARCHIVE/NAME.json: results kept in the repository, so a sweep spans sessions)."""
    out = root / "runs" / run.name
    result_path = out / "result.json"
    kept = archive / f"{run.name}.json" if archive else None
    for path in (result_path, kept):
        if path is not None and path.exists():
            return {**json.loads(path.read_text()), "skipped": True}
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / "checkpoints"
    resume = model.save_interval > 0 and (ckpt / "latest_checkpointed_iteration.txt").exists()
    if not resume:  # resuming, Megatron keeps the metrics up to the checkpoint and appends
        (out / "metrics.jsonl").unlink(missing_ok=True)
    saving = ["--save", str(ckpt), "--save-interval", str(model.save_interval)] if model.save_interval > 0 else []
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(run.nproc),
           "-m", "megatron_async.launch", "--gpt", *run.args(model, data, out), *saving,
           *(["--load", str(ckpt)] if resume else [])]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    start = time.monotonic()
    with open(out / "train.log", "w", encoding="utf-8") as log:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s,
                              preexec_fn=_die_with_parent)
    seconds = time.monotonic() - start
    if proc.returncode != 0:
        tail = (out / "train.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"run {run.name} failed (exit {proc.returncode}); see {out / 'train.log'}:\n{tail}")
    records = [json.loads(line) for line in open(out / "metrics.jsonl", encoding="utf-8")]
    vals = [(r["iteration"], r["val_loss"]) for r in records if "val_loss" in r]
    losses = [(r["iteration"], r["lm_loss"]) for r in records if r.get("lm_loss") is not None]
    if not losses or losses[-1][0] < model.iters:  # e.g. --exit-interval: not a result to compare
        raise RuntimeError(f"run {run.name} stopped at iteration {losses[-1][0] if losses else 0} of "
                           f"{model.iters}" + ("; its checkpoints are kept: run again to resume" if saving else ""))
    result = dict(name=run.name, optimizer=run.optimizer, lr=run.lr, mode=run.mode, seed=run.seed,
                  nproc=run.nproc, final_val_loss=_final_val_loss(records), val_curve=vals, train_curve=losses,
                  seconds=round(seconds, 1), command=" ".join(cmd[1:]), resumed=resume)
    result_path.write_text(json.dumps(result))
    shutil.rmtree(ckpt, ignore_errors=True)  # the result is kept; the checkpoints were only for resuming
    if kept is not None:
        kept.parent.mkdir(parents=True, exist_ok=True)
        kept.write_text(json.dumps(result))
    return result


def run_all(runs: list[Run], model: Model, data: Path, root: Path, parallel: int, timeout_s: float,
            done: list[int], total: int, t0: float, archive: Path | None = None) -> dict[str, dict]:
    """Run `runs` `parallel` at a time, printing a progress line per finished run.
    `done` counts [finished, skipped] across calls, for the ETA."""
    results = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=parallel) as pool:
        futures = {pool.submit(execute, r, model, data, root, timeout_s, archive): r for r in runs}
        for future in concurrent.futures.as_completed(futures):
            result = future.result()
            results[result["name"]] = result
            done[0] += 1
            done[1] += bool(result.get("skipped"))
            elapsed = time.monotonic() - t0
            fresh = done[0] - done[1]  # runs that trained in this invocation
            eta = elapsed / max(fresh, 1) * (total - done[0]) if fresh else float("nan")
            state = "skipped (done before)" if result.get("skipped") else f"{result['seconds']:.0f} s"
            print(f"[{done[0]:3d}/{total}] {result['name']:34s} final val {result['final_val_loss']:.4f} "
                  f"| {state} | elapsed {elapsed / 60:.1f} min | ETA {eta / 60:.1f} min", flush=True)
    return results


def cell(values: list[float]) -> dict:
    """{mean, std, runs} of some final losses."""
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"mean": statistics.fmean(values), "std": std, "runs": list(values)}


def mean_curve(curves: list[list]) -> tuple[list, list]:
    """Iterations and the mean loss over seeds of [(iteration, loss), ...] curves."""
    its = [it for it, _ in curves[0]]
    return its, [statistics.fmean(c[i][1] for c in curves) for i in range(len(its))]


def prepare_dirs(out: str, data: str, img_dir) -> tuple[Path, Path, Path]:
    """Absolute output, data and image directories; prepares the corpus if it is missing."""
    root, data_dir = Path(out).resolve(), Path(data).resolve()
    img = Path(img_dir).resolve() if img_dir else root
    root.mkdir(parents=True, exist_ok=True)
    img.mkdir(parents=True, exist_ok=True)
    if not (data_dir / "tokenizer.model").exists():
        subprocess.run([str(BIN / "megatron-async-prepare-data"), "--out", str(data_dir)], check=True)
    return root, data_dir, img

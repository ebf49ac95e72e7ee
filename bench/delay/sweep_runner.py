"""Running many `megatron-async-pretrain` jobs for a benchmark sweep, resumably.

Each run is a subprocess (Megatron's own training loop with the plugin) with its own
directory OUT/runs/NAME; a finished run
leaves result.json there (final validation loss, curves, seconds, command) and is
skipped by the next invocation, so an interrupted sweep resumes where it stopped.
Runs go `parallel` at a time, one thread each, with a progress line per run.
Shared by bench/delay/delay_sweep.py and bench/delay/variable_delay.py.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.launch import BENCH_WARM_ENV, start_torchrun

REPO = Path(__file__).resolve().parents[2]
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
    num_experts: int = 0  # > 0: every MLP an MoE layer (top-k routing, aux loss)
    moe_ffn_hidden_size: int = 0
    moe_topk: int = 2
    moe_aux_loss_coeff: float = 1e-2  # Megatron's usual coefficient
    # Muon's Newton-Schulz matmuls: Megatron's default "medium" (None) runs them in
    # bf16, which the CPU emulates 17-31x slower than "high" (bench/overhead/muon_matmul_precision.py); the delay
    # studies use "high", for every run they compare
    muon_matmul_prec: str | None = None

    def architecture(self) -> list[str]:
        """The flags that define the network: what archived runs must share to be reused."""
        flags = ["--num-layers", str(self.num_layers), "--hidden-size", str(self.hidden_size),
                 "--num-attention-heads", str(self.heads), "--seq-length", str(self.seq_length)]
        if self.num_experts:
            flags += ["--num-experts", str(self.num_experts), "--moe-router-topk", str(self.moe_topk),
                      "--moe-ffn-hidden-size", str(self.moe_ffn_hidden_size),
                      "--moe-aux-loss-coeff", f"{self.moe_aux_loss_coeff:g}"]
        return flags

    def parameters(self, padded_vocab: int = 4096) -> int:
        """Megatron's parameter count for this GPT (untied output layer, learned positions;
        the MoE model has no linear biases), at the Shakespeare tokenizer's padded
        vocabulary. Runs record Megatron's own count; this is for runs that did not."""
        h, f = self.hidden_size, self.moe_ffn_hidden_size
        if self.num_experts:
            layer = 4 * h * h + 4 * h + self.num_experts * (h + 2 * h * f)
        else:
            layer = 12 * h * h + 13 * h
        return self.num_layers * layer + 2 * padded_vocab * h + self.seq_length * h + 2 * h

    def recipe(self) -> list[str]:
        """Training flags besides the network's that archived runs must share to be reused."""
        return ["--muon-fp32-matmul-prec", self.muon_matmul_prec] if self.muon_matmul_prec else []

    def flags(self) -> list[str]:
        # no biases in the MoE model (Megatron's expert layers add them in place on a view on the CPU path)
        moe = ["--moe-router-load-balancing-type", "aux_loss", "--moe-token-dispatcher-type", "alltoall",
               "--disable-bias-linear"]
        return [
            *self.architecture(), *(moe if self.num_experts else []), *self.recipe(),
            "--max-position-embeddings", str(self.seq_length),
            "--micro-batch-size", str(self.micro_batch_size), "--global-batch-size", str(self.global_batch_size),
            "--train-iters", str(self.iters), "--eval-interval", str(self.eval_interval),
            "--eval-iters", str(self.eval_iters), "--log-interval", str(self.eval_interval),
            "--untie-embeddings-and-output-weights", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--lr-decay-style", "cosine", "--lr-warmup-iters", str(max(1, self.iters // 10)),
            "--weight-decay", "0.1", "--clip-grad", "1.0",
            "--position-embedding-type", "learned_absolute", "--rerun-mode", "disabled", "--num-workers", "0",
        ]


# The models of the delay studies: the dense GPT of docs/reproduction.md
# (1.9M parameters), one at least 4x larger, and the dense GPT with every MLP an MoE
# layer of 8 experts, top-2, each expert half the dense MLP's width, so a token's
# active parameters are about the dense model's.
OPTIONAL_FLAGS = ("--num-experts", "--muon-fp32-matmul-prec")  # absent in some models' commands
PRESETS = {
    "dense": {},
    "dense-large": {"num_layers": 8, "hidden_size": 256},
    "moe": {"num_experts": 8, "moe_topk": 2, "moe_ffn_hidden_size": 2 * 128},
}


def mismatched_architecture(command: str, model: Model) -> str | None:
    """The first network or recipe flag (Model.architecture, Model.recipe) whose value in
    an archived run's `command` differs from `model`'s, or None. A flag one side lacks
    counts as absent there."""
    words = command.split()
    given = dict(zip(words, words[1:] + [""]))
    wanted = model.architecture() + model.recipe()
    wanted_values = dict(zip(wanted[::2], wanted[1::2]))
    for flag in [*wanted_values, *(f for f in OPTIONAL_FLAGS if f not in wanted_values)]:
        if given.get(flag) != wanted_values.get(flag):
            return (f"{flag} {given.get(flag, '(absent)')} in the archived run, "
                    f"{wanted_values.get(flag, '(absent)')} in this sweep")
    return None


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


def routing_windows(records, window: int) -> dict | None:
    """An MoE run's routing records (megatron_lm/observability/moe_routing) as means over consecutive
    windows of `window` iterations: {iterations (each window's last), aux_loss,
    load_imbalance, load_imbalance_layers}; None for a dense run."""
    rows = [r for r in records if r.get("moe_load_imbalance") is not None]
    if not rows:
        return None
    out = {"iterations": [], "aux_loss": [], "load_imbalance": [], "load_imbalance_layers": []}
    for start in range(0, len(rows), window):
        chunk = rows[start:start + window]
        out["iterations"].append(chunk[-1]["iteration"])
        out["aux_loss"].append(statistics.fmean(r.get("moe_aux_loss") or 0.0 for r in chunk))
        out["load_imbalance"].append(statistics.fmean(r["moe_load_imbalance"] for r in chunk))
        layers = zip(*(r["moe_load_imbalance_layers"] for r in chunk))
        out["load_imbalance_layers"].append([statistics.fmean(v) if None not in v else None for v in layers])
    return out


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
            result = json.loads(path.read_text())
            other = mismatched_architecture(result.get("command", ""), model)
            if other:  # never reuse a run of another network under this one's name
                raise RuntimeError(f"{path}: trained another model ({other}); use another --archive or --out")
            return {**result, "skipped": True}
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
    if os.environ.get(BENCH_WARM_ENV) == "1":  # the smoke tests: warm ranks (tests/support/launch.py)
        proc = start_torchrun(cmd, cwd=REPO, env=env, log_path=out / "train.log").wait(timeout_s)
    else:
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
    counted = re.search(r"number of parameters on .*?: (\d+)", (out / "train.log").read_text(errors="replace"))
    if counted and run.nproc == 1:
        result["parameters"] = int(counted.group(1))
    routing = routing_windows(records, model.eval_interval)
    if routing is not None:
        result["routing"] = routing
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

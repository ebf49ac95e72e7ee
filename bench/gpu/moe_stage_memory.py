"""A middle stage of the 10B MoE on one GPU: its measured peak memory against the plan's.

    python -m bench.gpu.moe_stage_memory [--stage 2] [--iters 4] [--microbatches 8] [--json PATH]
    python -m bench.gpu.moe_stage_memory --cpu-dry-run --json out/moe_stage_memory_dry.json

As the device command of a lent GPU (installs the carried wheels, writes to $OUT):

    bash bench/gpu/run_moe_stage_memory.sh            # carry: .whl

The memory plan of examples/moe_10b (megatron_async.planning.plan) is an estimate; this
runs one middle stage of that configuration as closely as one
GPU allows, reads its peak GPU memory, and sets it beside the plan's figure for exactly
the configuration that ran. Within 10% passes; otherwise the per-term readings below say
which part (persistent state or activations) the plan gets wrong.

What runs. The flags are examples/moe_10b/flags.sh's (sourced with MOCK_DATA=1, so
Megatron's mock data), changed only where one GPU must differ:

- Layers: the stage's own count from the planner's layout (stage 2: 7 layers, the most
  of any stage; stage 1: 6), at the config's shape (hidden 2048, 16 heads, seq 4096,
  micro-batch 1, SwiGLU, RMSNorm, QK-norm, no biases, bf16, Muon with the distributed
  optimizer, which Megatron turns into its layer-wise one for Muon, EF correction).
- Pipeline: PP=1 with `--simulated-delay 1` instead of PP=4 with `--pipeline-schedule 2bw`:
  the same one-step delay and the same weight stash (one more bf16 copy of the weights),
  without a pipeline. A single process at PP=1 always builds an embedding and an output
  layer, which a middle stage has not; the vocabulary is shrunk (`--vocab-size`, 1024 by
  default, padded to 1152: 2 x 1152 x 2048 = 4.7M parameters, 1% of the stage's, and
  18 MiB of fp32 logits) so that they stay small and the run is the stage's layers. Give
  `--vocab-size 0` to keep the config's 50,304 (then the last stage's logits are in it too).
- Experts, folded: at EP=8 one GPU holds 64 / 8 = 8 experts of each layer, and the
  alltoall dispatcher brings it, on average, the tokens of 8 ranks x top-8 / 64 experts x
  8 local experts = one rank's tokens x 8 expert activations. `--num-experts 8
  --moe-router-topk 8 --expert-model-parallel-size 1` holds the same 8 experts of FFN 1024
  per layer (the same expert weights, gradients and optimizer state per GPU) and routes
  each token to all 8 of them: tokens x 8 expert activations, the same routed activation
  memory, and exactly balanced (the real run's balance holds only on average; an
  imbalanced real layer has a larger peak, not counted here). The router shrinks from
  64 to 8 rows of 2048 (0.8M parameters fewer over 7 layers). The plan for the folded
  run gives the same per-GPU parameter count as the real stage's to within 1%; the
  script prints both.
- m: the batch is micro-batch 1 x `--microbatches` (8 by default, the real run's m is
  64), and `--iters` iterations (4: every state, the optimizer's and the correction's
  included, exists by the end of the first step; the peak is read after the last). At PP=1 the
  microbatches of an iteration run one after another and each frees its activations at
  its backward, gradients accumulate in place, so m changes the time, not the memory;
  in the plan m enters only p2p_buffers, which PP=1 has none of.
- Kernels: Megatron's local layers (no Transformer Engine on the lent GPUs), with the
  fused kernels that need apex or TE off (tests/support/gpu/gpt_flags.py's "local", and
  `--no-rope-fusion`, which needs TE).

What is compared. The plan is run for the very same flags at `--world-size 1` (PP=1,
EP=1, DP=1), and its total against torch's max_memory_allocated from the run's
`--metrics-json` (the plan's stash term counts `--simulated-delay 1`'s copy, as
safety/save_space.stash_copies says). What this run has that a Transformer Engine run
has not:

- attention: Megatron's local DotProductAttention materialises the s x s scores. The
  plan counts them in its `attention_scores` term (plan.py's docstring: the stored
  softmax outputs, 2 x heads x s^2 x b bytes a layer, 512 MiB at 16 heads and s 4096;
  one layer's backward working set; the global score buffer), which is 0 for the flash
  or fused attention of a Transformer Engine run. Two runs: local attention as it is,
  then `--recompute-granularity selective` (core attention recomputed in the backward,
  so no layer keeps its softmax output: the activations a flash run keeps, plus the
  recompute's working set).

`--breakdown-step N` takes step N's peak apart with torch's allocator trace
(bench/gpu/allocation_peak.py): the blocks alive at the peak, by the Megatron code that
allocated them. That is how the plan's terms were checked one by one. `--set=--FLAG=VALUE`
runs another shape (e.g. --set=--seq-length=2048), to check the plan where it was not fitted.

Beside the peak, the launched process records at every training step the memory
allocated before and after it (the persistent state: weights, stash, gradient buffer,
fp32 main weights, Muon's momentum, the EF buffer, the attention buffer) and the
allocator's reserved peak: so the plan's persistent terms and its activation term are
each compared with what they describe.

What is not compared: the real stage's DP=8 sharding of the dense parameters'
optimizer and EF state (DP=1 here: the whole of it, which the plan for world size 1
also counts), its activations of (p - s) microbatches in flight (one here), its 2bw
point-to-point buffers, its router's 64 rows and the alltoall's imbalance, TE's
kernels and flash attention. The real stage's plan is printed beside this one's, term
by term.

On the CPU (`--cpu-dry-run`, or wherever CUDA is absent) the same path runs at a tiny
size (2 layers, hidden 64, seq 128: the same flags otherwise, through gloo and the
CPU emulation) to check the script, and reports that no GPU memory was measured.

Time on one H200: 38-64 s a launch, two launches (local attention, then selective
recompute), about 2 minutes with the wheels' install; results in docs/benchmarks.md.
The first launch's result is written to the JSON before the second starts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.results import emit

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "examples/moe_10b/flags.sh"
CONFIG_WORLD = 32  # examples/moe_10b/plan.sh's world size: PP=4 x DP=8
ENTRY_FLAG = "--moe-stage-memory-entry"  # first argument when the launcher runs this file as its script
STEPS_ENV = "MOE_STAGE_MEMORY_STEPS"
BREAKDOWN_ENV = "MOE_STAGE_MEMORY_BREAKDOWN_STEP"  # the step whose peak the allocator trace takes apart
MODES = {"local": [], "selective": ["--recompute-granularity", "selective"]}
# Megatron's local layers on a GPU without Transformer Engine or apex (tests/support/gpu/gpt_flags.py's
# IMPLS["local"]), and RoPE without TE's fused kernel (Megatron refuses the fusion without TE)
LOCAL = ["--transformer-impl", "local", "--no-masked-softmax-fusion", "--no-persist-layer-norm",
         "--no-gradient-accumulation-fusion", "--no-rope-fusion"]
# a cluster run's outputs, which a measurement of a few iterations does not want
# --overlap-moe-expert-parallel-comm: the fold has no expert parallelism, so no all-to-all to overlap
# (Megatron refuses the flag at EP=1), and no pipeline for 2bw's deeper warm-up
DROPPED = ("--save", "--load", "--save-interval", "--exit-signal-handler", "--tensorboard-dir",
           "--data-cache-path", "--pipeline-model-parallel-layout", "--pipeline-schedule",
           "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
           "--overlap-moe-expert-parallel-comm")
TINY = {"--hidden-size": 64, "--num-attention-heads": 4, "--seq-length": 128, "--max-position-embeddings": 128,
        "--moe-ffn-hidden-size": 32}
PERSISTENT = ("weights", "stash", "gradients", "optimizer", "ef_buffer", "p2p_buffers", "tied_link")
# activation-side terms; of attention_scores one score tensor (Megatron's global buffer) persists
ACTIVATION = ("activations", "attention_scores")
MIB = 2**20
# flags stage_flags sets itself, which --set may not change
FIXED = {"--num-layers", "--num-experts", "--expert-model-parallel-size", "--pipeline-model-parallel-size",
         "--tensor-model-parallel-size", "--simulated-delay", "--global-batch-size", "--train-iters",
         "--metrics-json", "--recompute-granularity", *(f for f in LOCAL if f.startswith("--"))}


# -- flags ------------------------------------------------------------------------------------------------

def config_flags(config: str = CONFIG) -> list[str]:
    """TRAIN_ARGS of a cluster config (examples/*/flags.sh), with Megatron's mock data."""
    with tempfile.TemporaryDirectory() as run_dir:
        env = {**os.environ, "RUN_DIR": run_dir, "MOCK_DATA": "1"}
        out = subprocess.run(["bash", "-c", 'source "$1" && printf "%s\\0" "${TRAIN_ARGS[@]}"', "bash", config],
                             cwd=ROOT, env=env, check=True, capture_output=True, text=True).stdout
    return out.split("\0")[:-1]


class Flags:
    """A Megatron command line as (flag, values) pairs: read, set and drop flags by name."""

    def __init__(self, argv):
        self.items: list[tuple[str, list[str]]] = []
        for token in map(str, argv):
            if token.startswith("--"):
                self.items.append((token, []))
            elif self.items:
                self.items[-1][1].append(token)
            else:
                raise ValueError(f"a value before any flag: {token!r}")

    def has(self, flag: str) -> bool:
        return any(name == flag for name, _ in self.items)

    def value(self, flag: str, default=None):
        found = [values for name, values in self.items if name == flag]
        return found[-1][0] if found and found[-1] else default

    def set(self, flag: str, *values) -> "Flags":
        values = [str(v) for v in values]
        for i, (name, _) in enumerate(self.items):
            if name == flag:
                self.items[i] = (flag, values)
                return self
        self.items.append((flag, values))
        return self

    def drop(self, flag: str) -> "Flags":
        self.items = [(name, values) for name, values in self.items if name != flag]
        return self

    def argv(self) -> list[str]:
        return [part for name, values in self.items for part in (name, *values)]


def config_stage_layers(config: list[str]) -> list[int]:
    """The transformer layers of each pipeline stage of the config (its layout, else Megatron's split)."""
    from megatron_async.planning.balance import layers_per_stage

    flags = Flags(config)
    first, last = (flags.value(f"--decoder-{end}-pipeline-num-layers") for end in ("first", "last"))
    return layers_per_stage(int(flags.value("--num-layers")), int(flags.value("--pipeline-model-parallel-size", 1)),
                            int(first) if first else None, int(last) if last else None,
                            flags.value("--pipeline-model-parallel-layout"))


def folded_experts(flags: Flags) -> tuple[int, int]:
    """(experts, top-k) on one GPU holding one expert-parallel rank's experts at EP=1."""
    experts, ep = int(flags.value("--num-experts")), int(flags.value("--expert-model-parallel-size", 1))
    topk = int(flags.value("--moe-router-topk", 2))
    if experts % ep:
        raise ValueError(f"--num-experts {experts} is not divisible by --expert-model-parallel-size {ep}")
    if topk > experts // ep:
        raise ValueError(f"top-{topk} of {experts // ep} local experts cannot be folded onto one GPU")
    return experts // ep, topk


def stage_flags(config: list[str], layers: int, *, iters: int, microbatches: int, vocab: int, tiny: bool,
                mode: str, metrics: Path, overrides: tuple[str, ...] = ()) -> list[str]:
    """The config's flags for one pipeline stage's `layers` on one GPU (module docstring)."""
    flags = Flags(config)
    experts, _ = folded_experts(flags)
    for flag in DROPPED:
        flags.drop(flag)
    if tiny:
        for flag, value in TINY.items():
            flags.set(flag, value)
    for override in overrides:  # "--seq-length=2048": another shape of the same stage, to test the plan's scaling
        flag, _, value = override.partition("=")
        if flag in FIXED:
            raise SystemExit(f"--set {flag}: this script sets {flag} itself (the stage's layers, the fold, the modes)")
        flags.set(flag, *value.split())
    micro = int(flags.value("--micro-batch-size", 1))
    flags.set("--num-layers", layers).set("--num-experts", experts).set("--expert-model-parallel-size", 1)
    flags.set("--pipeline-model-parallel-size", 1).set("--tensor-model-parallel-size", 1)
    flags.set("--simulated-delay", 1)
    flags.set("--global-batch-size", micro * microbatches).set("--train-iters", iters).set("--lr-warmup-iters", 0)
    flags.set("--log-interval", 1).set("--eval-interval", 100000).set("--eval-iters", 1).set("--num-workers", 0)
    flags.set("--metrics-json", metrics)
    if vocab:
        flags.set("--vocab-size", vocab)
    for flag in LOCAL:
        flags.drop(flag)
    return flags.argv() + LOCAL + MODES[mode]


# -- the launched process -----------------------------------------------------------------------------------

def _gpu_memory() -> dict | None:
    import torch

    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    out = {"allocated_mib": torch.cuda.memory_allocated() / MIB,
           "max_allocated_mib": torch.cuda.max_memory_allocated() / MIB,
           "reserved_mib": torch.cuda.memory_reserved() / MIB,
           "max_reserved_mib": torch.cuda.max_memory_reserved() / MIB}
    try:  # Megatron's global buffer: the local attention's s x s score buffer lives there
        from megatron.core import parallel_state

        buffers = parallel_state.get_global_memory_buffer().buffer.values()
        out["global_buffer_mib"] = sum(t.numel() * t.element_size() for t in buffers) / MIB
    except Exception:  # not initialised, or Megatron moved it: the record goes without
        pass
    return out


def entry(argv: list[str]) -> None:
    """Run by megatron_async.launch as its script (hooks and, without CUDA, the emulation in
    place): Megatron's train_step wrapped to record the GPU memory around every step, then
    the plugin's GPT entry, as `launch --gpt` runs it."""
    import torch
    from megatron.training import training

    from bench.gpu import allocation_peak
    from megatron_async import launch

    path, step = os.environ[STEPS_ENV], [0]
    original = training.train_step

    def write(record: dict) -> None:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        write({"device": props.name, "total_mib": props.total_memory / MIB, "torch": torch.__version__})

    traced = int(os.environ.get(BREAKDOWN_ENV, 0) or 0)

    def train_step(*args, **kwargs):
        before = _gpu_memory()
        trace, error = traced == step[0] + 1 and torch.cuda.is_available(), None
        try:
            state = allocation_peak.record_start() if trace else None
        except Exception as err:  # the measurement goes on without its breakdown, which says why
            trace, error = False, err
        out = original(*args, **kwargs)
        step[0] += 1
        if trace:
            try:
                write({"breakdown": allocation_peak.record_stop(state), "of_step": step[0]})
            except Exception as err:
                error = err
        if error is not None:
            write({"breakdown": {"error": repr(error)}, "of_step": step[0]})
        write({"step": step[0], "before": before, "after": _gpu_memory()})
        return out

    training.train_step = train_step
    launch._run("--gpt", argv)


# -- the driver ---------------------------------------------------------------------------------------------

def _env(cpu: bool = False) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(PYTHONUNBUFFERED="1", CUDA_DEVICE_MAX_CONNECTIONS="1", OMP_NUM_THREADS="4")
    if cpu:  # no GPU: the planner (which needs none) runs as on a CPU-only machine, off the device
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def start_plan(flags: list[str], world: int, path: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "megatron_async.planning.plan", "--world-size", str(world), "--gpu-gb", "1000",
           "--json", str(path), "--", *flags]
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(cpu=True), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def finish_plan(proc: subprocess.Popen, path: Path, timeout: float) -> dict:
    out, _ = proc.communicate(timeout=timeout)
    if not path.exists():  # plan.py exits 1 when a stage does not fit, with its JSON written
        sys.exit(f"the planner failed (exit {proc.returncode}):\n{out[-4000:]}")
    return json.loads(path.read_text())


def launch(flags: list[str], steps: Path, timeout: float, cpu: bool, breakdown_step: int = 0) -> tuple[int, str, float]:
    """torchrun, one process: megatron_async.launch with this file as its script (a dry run
    stays on the CPU, with the launcher's CPU flags and the emulation, even beside a GPU)."""
    import time

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           "-m", "megatron_async.launch", str(Path(__file__).resolve()), ENTRY_FLAG, *flags]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**_env(cpu=cpu), STEPS_ENV: str(steps), BREAKDOWN_ENV: str(breakdown_step)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        return 124, out, time.perf_counter() - start
    except BaseException:
        os.killpg(proc.pid, 9)
        proc.wait()
        raise
    return proc.returncode, out, time.perf_counter() - start


def megatron_memory_lines(log: str) -> list[str]:
    """Megatron's own memory lines (its theoretical footprint, its report after iteration 1)."""
    keys = ("Theoretical memory footprints", "Activation memory footprint", "memory (MB)",
            "number of parameters on")
    lines = [line.strip() for line in log.splitlines() if any(k in line for k in keys)]
    return list(dict.fromkeys(lines))


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().startswith("{")]


def compare(plan_row: dict, records: list[dict], steps: list[dict], score_mib: float) -> dict:
    """The plan's terms (MiB) and the run's readings side by side; measured values None on the CPU.
    `score_mib`: one s x s score tensor, the global buffer that persists when the plan counts scores."""
    plan = {k: v * 1024 for k, v in plan_row["memory_gb"].items()}
    plan_total = plan_row["total_gb"] * 1024
    buffer = score_mib if plan.get("attention_scores") else 0.0
    plan_persistent = sum(plan[k] for k in PERSISTENT if k in plan) + buffer
    out = {"plan_mib": plan, "plan_total_mib": plan_total, "plan_persistent_mib": plan_persistent,
           "plan_activations_mib": sum(plan.get(k, 0) for k in ACTIVATION) - buffer,
           "iterations": len([r for r in records if "lm_loss" in r]), "steps_recorded": len(steps)}
    peaks = [r["max_allocated_mib"] for r in records if "max_allocated_mib" in r]
    if not peaks:
        out.update(measured=False, verdict="not measured: no GPU (CPU dry run)")
        return out
    peak = max(peaks)
    out.update(measured=True, peak_mib=peak, peak_per_iteration_mib=peaks, ratio=peak / plan_total)
    gpu_steps = [s for s in steps if s.get("before")]
    if gpu_steps:  # the launched process's own readings around each step
        last = gpu_steps[-1]
        persistent = last["before"]["allocated_mib"]  # from step 2 on every state exists: stash, grads, optimizer, EF
        out.update(persistent_mib=persistent, above_persistent_mib=peak - persistent,
                   max_reserved_mib=max(s["after"]["max_reserved_mib"] for s in gpu_steps),
                   global_buffer_mib=last["before"].get("global_buffer_mib"),
                   allocated_per_step_mib=[[s["before"]["allocated_mib"], s["after"]["allocated_mib"]]
                                           for s in gpu_steps],
                   persistent_ratio=persistent / plan_persistent,
                   activation_ratio=(peak - persistent) / out["plan_activations_mib"]
                   if out["plan_activations_mib"] else None)
    out["within_10_percent"] = abs(out["ratio"] - 1) <= 0.10
    out["verdict"] = (f"{'within' if out['within_10_percent'] else 'outside'} 10%: measured / plan = "
                      f"{out['ratio']:.3f}")
    return out


def score_tensor_mib(flags: Flags) -> float:
    """One layer's s x s attention scores in bf16 (MiB): the unit of the plan's attention_scores."""
    heads, seq = int(flags.value("--num-attention-heads")), int(flags.value("--seq-length"))
    return 2 * heads * seq * seq * int(flags.value("--micro-batch-size", 1)) / MIB


def table(result: dict) -> str:
    lines = [f"moe_10b stage {result['stage']} ({result['layers']} layers) on {result['device']}: "
             f"plan at world size 1 for the flags that ran, and the real stage's plan (PP=4, EP=8, DP=8, "
             f"the config's shape without --set) for reference"]
    real = {k: v * 1024 for k, v in result["real_stage_plan"]["memory_gb"].items()}
    modes = list(result["modes"])
    lines.append("| term (MiB) | " + " | ".join(f"plan, {m}" for m in modes) + " | plan, real stage |")
    lines.append("| --- |" + " --- |" * (len(modes) + 1))
    for term in real:
        cells = [f"{result['modes'][m]['plan_mib'][term]:.0f}" for m in modes]
        lines.append(f"| {term} | " + " | ".join(cells) + f" | {real[term]:.0f} |")
    lines.append("| **total compared** | " + " | ".join(f"{result['modes'][m]['plan_total_mib']:.0f}" for m in modes)
                 + f" | {result['real_stage_plan']['total_gb'] * 1024:.0f} |")
    lines.append(f"parameters on the GPU: this run {result['gpu_params'] / 1e9:.4f}B, the real stage "
                 f"{result['real_stage_plan']['gpu_params'] / 1e9:.4f}B")
    for m in modes:
        r = result["modes"][m]
        lines.append(f"{m}: {r['iterations']} iterations, launch {r['wall_s']:.0f} s; {r['verdict']}")
        if r["measured"]:
            lines.append(f"  peak (max_allocated) {r['peak_mib']:.0f} MiB against the plan's {r['plan_total_mib']:.0f}")
        if r.get("persistent_mib") is not None:
            lines.append(f"  max reserved {r['max_reserved_mib']:.0f} MiB; allocated before/after each step "
                         + ", ".join(f"{before:.0f}/{after:.0f}" for before, after in r["allocated_per_step_mib"]))
            lines.append(f"  persistent (allocated at the last step's start) {r['persistent_mib']:.0f} against the "
                         f"plan's {r['plan_persistent_mib']:.0f} ({r['persistent_ratio']:.3f}); of it Megatron's "
                         f"global buffer {r['global_buffer_mib'] or 0:.0f}")
            act = f" ({r['activation_ratio']:.3f})" if r["activation_ratio"] else ""
            lines.append(f"  peak above it {r['above_persistent_mib']:.0f} against the plan's activations and "
                         f"attention scores {r['plan_activations_mib']:.0f}{act}")
    return "\n".join(lines)


def breakdown_table(mode: str, b: dict, rows: int = 20) -> str:
    full = "; the trace wrapped: its first events are lost" if b["trace_full"] else ""
    lines = [f"{mode}: at the traced step's peak, {b['peak_mib']:.0f} MiB ({b['base_mib']:.0f} before the step, "
             f"{b['peak_above_base_mib']:.0f} allocated in it; the allocator's peak before the step "
             f"{b['max_allocated_before_mib']:.0f}, after it {b['max_allocated_mib']:.0f}{full}), "
             f"{b['live_blocks']} blocks; the peak reached at: {b['peak_event_site']}",
             "| MiB | blocks | sizes (MiB: count) | allocated by |", "| --- | --- | --- | --- |"]
    for g in b["groups"][:rows]:
        sizes = ", ".join(f"{k}: {v}" for k, v in list(g["sizes_mib"].items())[:4])
        lines.append(f"| {g['mib']:.0f} | {g['blocks']} | {sizes} | {g['site']} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stage", type=int, default=2, help="the pipeline stage of the config to run (2: 7 layers)")
    ap.add_argument("--iters", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8, help="m of the run (memory does not depend on it at PP=1)")
    ap.add_argument("--vocab-size", type=int, default=1024, help="0: the config's")
    ap.add_argument("--modes", default="local,selective", help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--cpu-dry-run", action="store_true", help="the tiny size on the CPU (also where CUDA is absent)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds a launch may take")
    ap.add_argument("--config", default=CONFIG)
    ap.add_argument("--world-size", type=int, default=CONFIG_WORLD, help="the config's world size (its plan.sh's)")
    ap.add_argument("--set", action="append", default=[], metavar="--FLAG=VALUE",
                    help="change a flag of the run (and of its plan), e.g. --set=--seq-length=2048")
    ap.add_argument("--breakdown-step", type=int, default=0,
                    help="take this step's peak apart with torch's allocator trace (bench/gpu/allocation_peak.py)")
    ap.add_argument("--json")
    opts = ap.parse_args(argv)
    if opts.breakdown_step > opts.iters:
        ap.error(f"--breakdown-step {opts.breakdown_step} is beyond --iters {opts.iters}")
    import torch

    cpu = opts.cpu_dry_run or not torch.cuda.is_available()
    modes = [m for m in opts.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        sys.exit(f"unknown mode(s) {unknown}; choose from {list(MODES)}")
    config = config_flags(opts.config)
    result = {"config": opts.config, "stage": opts.stage, "cpu_dry_run": cpu,
              "options": {k: v for k, v in vars(opts).items() if k != "json"}, "modes": {}}
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        real_plan = start_plan(config, opts.world_size, tmp / "real_plan.json")  # beside the first launch
        stage_layers = config_stage_layers(config)[opts.stage]
        layers = min(stage_layers, 2) if cpu else stage_layers
        result.update(layers=layers, device="CPU (dry run: no GPU memory measured)")
        for mode in modes:
            metrics, steps = tmp / f"{mode}_metrics.jsonl", tmp / f"{mode}_steps.jsonl"
            flags = stage_flags(config, layers, iters=opts.iters, microbatches=opts.microbatches,
                                vocab=opts.vocab_size, tiny=cpu, mode=mode, metrics=metrics,
                                overrides=tuple(opts.set))
            plan_json = tmp / f"{mode}_plan.json"
            plan_proc = start_plan(flags, 1, plan_json)  # beside the run: the planner works on the CPU
            code, out, wall = launch(flags, steps, opts.timeout, cpu, opts.breakdown_step)
            plan = finish_plan(plan_proc, plan_json, opts.timeout)
            if "real_stage_plan" not in result:
                real = finish_plan(real_plan, tmp / "real_plan.json", opts.timeout)
                result["real_stage_plan"] = real["stages"][opts.stage]
                if result["real_stage_plan"]["layers"] != stage_layers:
                    sys.exit(f"the planner puts {result['real_stage_plan']['layers']} layers on stage {opts.stage}, "
                             f"the layout {stage_layers}")
            if code != 0:
                print(out[-6000:])
                result["modes"][mode] = {"failed": code, "wall_s": wall, "flags": flags, "log_tail": out[-4000:]}
                emit(result, f"{mode}: the launch failed (exit {code}{', timed out' if code == 124 else ''})",
                     opts.json)
                sys.exit(1)
            step_records = read_jsonl(steps)
            header = next((s for s in step_records if "device" in s), None)
            if header:
                result["device"] = f"{header['device']} ({header['total_mib']:.0f} MiB, torch {header['torch']})"
            prow = plan["stages"][0]
            result["gpu_params"] = prow["gpu_params"]
            records = read_jsonl(metrics)
            result["modes"][mode] = {**compare(prow, records, [s for s in step_records if "step" in s],
                                               score_tensor_mib(Flags(flags))),
                                     "losses": [r["lm_loss"] for r in records if "lm_loss" in r],
                                     "megatron_memory_lines": megatron_memory_lines(out),
                                     "wall_s": wall, "flags": flags}
            breakdown = next((s for s in step_records if "breakdown" in s), None)
            if breakdown:
                result["modes"][mode]["peak_breakdown"] = breakdown["breakdown"]
                print(breakdown.get("breakdown", {}).get("error") or breakdown_table(mode, breakdown["breakdown"]),
                      flush=True)
            if cpu and result["modes"][mode]["steps_recorded"] != opts.iters:
                sys.exit(f"{mode}: {result['modes'][mode]['steps_recorded']} steps recorded, not {opts.iters}")
            print(f"{mode}: {result['modes'][mode]['verdict']} ({wall:.0f} s)", flush=True)
            if opts.json:  # each mode's result kept as soon as it exists
                Path(opts.json).parent.mkdir(parents=True, exist_ok=True)
                Path(opts.json).write_text(json.dumps(result, indent=1))
    return emit(result, table(result), opts.json)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == ENTRY_FLAG:
        entry(sys.argv[2:])
    else:
        main()

"""PyTorch's own pipeline schedules (`torch.distributed.pipelining`) at PP=2, on CPU processes: a
one-off study, kept with its results (bench/archive/benchmarks_history.md).

    .venv/bin/python -m bench.archive.throughput.torch_pipelining [--repeats R] [--iters N] [--json PATH]
    .venv/bin/python -m bench.archive.throughput.torch_pipelining --quick      # tiny model, three configurations

Why: bench/throughput/pipeline_throughput.py measures our 2bw against Megatron's 1F1B inside
Megatron's training loop. This benchmark asks the matching question of PyTorch's own
pipelining library: how well do its synchronous schedule (Schedule1F1B) and its
zero-bubble schedules (ScheduleZBVZeroBubble, ScheduleDualPipeV, V placement with 2
stages per rank) do on a model of the same size (8 layers, hidden 256, 4 heads,
vocab 4096, seq 128, micro-batch 4, fp32)? The model is a plain PyTorch GPT written
here, so no Megatron code is involved; the yardstick is the same as there, the ideal
PP=2 bound (the same model's PP=1 time per microbatch / 2), so the efficiencies of both
benchmarks can be put side by side.

How it times: every configuration is a fresh set of processes (spawned with
torch.multiprocessing, gloo backend, OMP_NUM_THREADS=1 and torch.set_num_threads(1) in
each), seeded with the same weights and the same random tokens on every rank. One
iteration is one batch of m microbatches followed by one Adam step (lr 1e-4); PP=1
accumulates the m microbatch gradients itself. After WARMUP_ITERS iterations a barrier,
then each rank times --iters iterations with time.perf_counter; a run's rate is the
slower rank's time per microbatch. Configurations run round-robin, R times, so machine
noise hits all alike; the median over repeats is reported, with efficiency =
(PP=1 s / microbatch / 2) / configuration s / microbatch.

Zero-bubble schedules split each backward into an input-gradient pass (B) and a
weight-gradient pass (W); the split is not free. The same run also measures, in one
process on the PP=2 last stage (4 blocks + final norm + output layer + loss), a full
backward against the split one and reports split_backward_overhead =
(input + weight) / full - 1: once with plain torch.autograd.grad calls (input
gradient with the graph retained, then the parameter gradients), and once with the
functions PipelineStage itself calls (stage_backward_input / stage_backward_weight).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import queue
import statistics
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

from bench.results import emit
from tests.support.launch import BENCH_WARM_ENV

# (name, schedule, microbatches per batch)
CONFIGS = [
    ("pp1_m4", "pp1", 4),
    ("1f1b_m4", "1f1b", 4),
    ("1f1b_m8", "1f1b", 8),
    ("1f1b_m16", "1f1b", 16),
    ("zbv_m4", "zbv", 4),
    ("zbv_m8", "zbv", 8),
    ("dualpipev_m4", "dualpipev", 4),
    ("dualpipev_m8", "dualpipev", 8),
]
QUICK_CONFIGS = [c for c in CONFIGS if c[0] in ("pp1_m4", "1f1b_m4", "zbv_m4")]
# Schedules whose failure is recorded (errors) instead of stopping the benchmark.
MAY_FAIL = {"dualpipev"}
FULL_MODEL = dict(layers=8, hidden=256, heads=4, vocab=4096, seq=128, mbs=4)
QUICK_MODEL = dict(layers=2, hidden=32, heads=4, vocab=64, seq=16, mbs=2)
WARMUP_ITERS = 2
SEED = 1234
LR = 1e-4


# ---------------------------------------------------------------- model


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention and a 4x GELU MLP."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    """Decoder-only GPT: token + learned position embeddings, blocks, final norm, untied output layer."""

    def __init__(self, layers: int, hidden: int, heads: int, vocab: int, seq: int, **_):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class Chunk(nn.Module):
    """A contiguous piece of a GPT: optional embeddings, some blocks, optional norm + output layer."""

    def __init__(self, blocks: list[nn.Module], tok=None, pos=None, norm=None, head=None):
        super().__init__()
        self.tok, self.pos, self.norm, self.head = tok, pos, norm, head
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok is not None:
            x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        if self.head is not None:
            x = self.head(self.norm(x))
        return x


def chunk(gpt: GPT, start: int, stop: int, embed: bool, head: bool) -> Chunk:
    """Blocks [start, stop) of `gpt` (sharing its parameters), with embeddings and/or the head."""
    return Chunk(list(gpt.blocks[start:stop]), *((gpt.tok, gpt.pos) if embed else (None, None)),
                 *((gpt.norm, gpt.head) if head else (None, None)))


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def build(model: dict) -> GPT:
    """The GPT with seeded weights, identical on every rank."""
    torch.manual_seed(SEED)
    return GPT(**model)


def batch(model: dict, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded random tokens for m microbatches (inputs, next-token targets), identical on every rank."""
    g = torch.Generator().manual_seed(SEED + 1)
    tokens = torch.randint(model["vocab"], (m * model["mbs"], model["seq"] + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def v_bounds(layers: int) -> list[tuple[int, int]]:
    """Block ranges of the 4 virtual stages of the V placement: layers // 4 each when divisible.

    With fewer than 4 layers (--quick has 2) some virtual stages hold no block: stage 0 then
    is the embeddings alone and an inner stage is an identity.
    """
    return [(v * layers // 4, (v + 1) * layers // 4) for v in range(4)]


# ---------------------------------------------------------------- one iteration per schedule


def make_step(schedule: str, model: dict, m: int, rank: int):
    """A closure running one iteration (m microbatches, one Adam step) on this rank."""
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleDualPipeV,
                                              ScheduleZBVZeroBubble)

    gpt = build(model)
    inputs, targets = batch(model, m)
    cpu = torch.device("cpu")
    layers = model["layers"]
    if schedule == "pp1":
        opt = torch.optim.Adam(gpt.parameters(), lr=LR)

        def step():
            opt.zero_grad()
            for x, y in zip(inputs.chunk(m), targets.chunk(m)):
                (loss_fn(gpt(x), y) / m).backward()
            opt.step()
        return step

    if schedule == "1f1b":
        half = layers // 2
        piece = chunk(gpt, 0, half, embed=True, head=False) if rank == 0 else \
            chunk(gpt, half, layers, embed=False, head=True)
        pipe = Schedule1F1B(PipelineStage(piece, rank, 2, cpu), m, loss_fn=loss_fn)
        params = list(piece.parameters())
        args, kwargs = ((inputs,), {}) if rank == 0 else ((), {"target": targets})
    else:
        bounds = v_bounds(layers)
        local = sorted((rank, 3 - rank))  # V placement: rank 0 holds 0 and 3, rank 1 holds 1 and 2
        pieces = [chunk(gpt, *bounds[v], embed=v == 0, head=v == 3) for v in local]
        stages = [PipelineStage(p, v, 4, cpu) for p, v in zip(pieces, local)]
        cls = {"zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}[schedule]
        pipe = cls(stages, m, loss_fn=loss_fn)
        params = [p for piece in pieces for p in piece.parameters()]
        args, kwargs = ((inputs,), {"target": targets}) if rank == 0 else ((), {})
    opt = torch.optim.Adam(params, lr=LR)

    def step():
        opt.zero_grad()
        pipe.step(*args, return_outputs=False, **kwargs)
        opt.step()
    return step


# ---------------------------------------------------------------- processes


def _timed_run(rank: int, world: int, schedule: str, model: dict, m: int, iters: int) -> float:
    """Warm up, barrier, then this rank's seconds for `iters` iterations."""
    step = make_step(schedule, model, m, rank)
    for _ in range(WARMUP_ITERS):
        step()
    if world > 1:
        dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    return time.perf_counter() - start


def _worker(rank: int, world: int, store: str, timeout_s: float, results, fn, args: tuple):
    """Process body: one thread, gloo group when world > 1, report (rank, ok, payload) on `results`."""
    torch.set_num_threads(1)
    try:
        if world > 1:
            dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        results.put((rank, True, fn(rank, world, *args)))
    except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, False, (f"{type(e).__name__}: {e}".strip(), traceback.format_exc())))
    finally:
        if world > 1 and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


class RunFailed(RuntimeError):
    """A configuration's process failed; `short` is its exception line."""

    def __init__(self, message: str, short: str):
        super().__init__(message)
        self.short = short


@contextlib.contextmanager
def _env(**values):
    """Set environment variables for the duration (children spawned inside inherit them)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def launch(name: str, world: int, fn, args: tuple, timeout_s: float) -> list:
    """Run fn(rank, world, *args) in `world` fresh spawned processes; the per-rank results.

    Raises RunFailed naming the configuration and rank if a process raises, dies, or
    gives no result within timeout_s; every process is gone when this returns.
    """
    ctx = mp.get_context("spawn")
    if os.environ.get(BENCH_WARM_ENV) == "1":  # the smoke test: forked with torch imported (tests/support/launch.py)
        from tests.support.multiprocess import _context

        ctx = _context()
    results = ctx.Queue()
    got: dict[int, object] = {}
    with tempfile.TemporaryDirectory() as tmp, _env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"):
        procs = [ctx.Process(target=_worker, args=(r, world, f"{tmp}/store", timeout_s, results, fn, args),
                             daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        try:
            while len(got) < world:
                try:
                    rank, ok, payload = results.get(timeout=max(0.1, min(2.0, deadline - time.monotonic())))
                except queue.Empty:
                    for r, p in enumerate(procs):
                        if r not in got and p.exitcode is not None:
                            raise RunFailed(f"{name}: rank {r} exited with code {p.exitcode} without a result",
                                            f"exit code {p.exitcode}") from None
                    if time.monotonic() > deadline:
                        missing = [r for r in range(world) if r not in got]
                        raise RunFailed(f"{name}: rank(s) {missing} gave no result within {timeout_s:.0f} s",
                                        "timeout") from None
                    continue
                if not ok:
                    short, tb = payload
                    time.sleep(0.5)  # a peer that died first is the likelier cause: name it too
                    dead = "".join(f" (rank {r} exited with code {p.exitcode})" for r, p in enumerate(procs)
                                   if r != rank and p.exitcode not in (None, 0))
                    raise RunFailed(f"{name}: rank {rank} failed{dead}: {short}\n{tb}", f"rank {rank}{dead}: {short}")
                got[rank] = payload
            for r, p in enumerate(procs):
                p.join(timeout=max(5.0, deadline - time.monotonic()))
                if p.is_alive():
                    raise RunFailed(f"{name}: rank {r} did not exit after reporting", "no exit")
                if p.exitcode != 0:
                    raise RunFailed(f"{name}: rank {r} exited with code {p.exitcode}", f"exit code {p.exitcode}")
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
                    p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
            results.close()
    return [got[r] for r in range(world)]


def run(model: dict, config: tuple, iters: int, timeout_s: float) -> float:
    """One fresh run of a configuration: the slower rank's seconds per microbatch."""
    name, schedule, m = config
    world = 1 if schedule == "pp1" else 2
    seconds = launch(name, world, _timed_run, (schedule, model, m, iters), timeout_s)
    return max(seconds) / (iters * m)


# ---------------------------------------------------------------- split backward


def _split_backward(rank: int, world: int, model: dict, reps: int) -> dict:
    """Median seconds of full, autograd.grad-split and PipelineStage-split backward on the PP=2 last stage."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    gpt = build(model)
    layers = model["layers"]
    last = chunk(gpt, layers // 2, layers, embed=False, head=True)
    params = list(last.parameters())
    g = torch.Generator().manual_seed(SEED + 2)
    stage_input = torch.randn(model["mbs"], model["seq"], model["hidden"], generator=g)
    _, targets = batch(model, 1)

    def forward():
        for p in params:
            p.grad = None
        x = stage_input.detach().requires_grad_()
        return x, loss_fn(last(x), targets)

    def full():
        x, loss = forward()
        t0 = time.perf_counter()
        loss.backward()
        return {"full": time.perf_counter() - t0}

    def split_autograd():
        x, loss = forward()
        t0 = time.perf_counter()
        torch.autograd.grad(loss, [x], retain_graph=True)
        t1 = time.perf_counter()
        torch.autograd.grad(loss, params)
        return {"input": t1 - t0, "weight": time.perf_counter() - t1}

    def split_stage():
        x, loss = forward()
        t0 = time.perf_counter()
        _, groups = stage_backward_input([loss], None, [x], iter(params))
        t1 = time.perf_counter()
        stage_backward_weight(iter(params), groups)
        return {"stage_input": t1 - t0, "stage_weight": time.perf_counter() - t1}

    samples: dict[str, list[float]] = {}
    for r in range(reps + 2):  # two warm-up rounds
        for fn in (full, split_autograd, split_stage):
            for k, v in fn().items():
                if r >= 2:
                    samples.setdefault(k, []).append(v)
    return {k: statistics.median(v) for k, v in samples.items()}


def split_backward(model: dict, reps: int, timeout_s: float) -> dict:
    """Split-backward costs (seconds, medians) and overheads, measured in one fresh process."""
    (t,) = launch("split_backward", 1, _split_backward, (model, reps), timeout_s)
    return {**t, "reps": reps,
            "overhead_autograd_grad": (t["input"] + t["weight"]) / t["full"] - 1,
            "overhead_pipeline_stage": (t["stage_input"] + t["stage_weight"]) / t["full"] - 1}


# ---------------------------------------------------------------- driver


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iters", type=int, default=6, help="timed iterations per run (after warm-up)")
    parser.add_argument("--quick", action="store_true", help="tiny model, pp1_m4, 1f1b_m4, zbv_m4, one repeat")
    parser.add_argument("--json", default=None)
    parser.add_argument("--split-reps", type=int, default=10, help="repetitions of the split-backward measurement")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds one run may take before it fails")
    args = parser.parse_args(argv)
    model, configs = (QUICK_MODEL, QUICK_CONFIGS) if args.quick else (FULL_MODEL, CONFIGS)
    repeats, iters, split_reps = (1, 2, 3) if args.quick else (args.repeats, args.iters, args.split_reps)
    timeout_s = min(args.timeout, 120) if args.quick else args.timeout

    times: dict[str, list[float]] = {c[0]: [] for c in configs}
    errors: dict[str, str] = {}
    for r in range(repeats):
        for config in configs:
            name, schedule = config[:2]
            if name in errors:
                continue
            try:
                times[name].append(run(model, config, iters, timeout_s))
            except RunFailed as e:
                if schedule not in MAY_FAIL:
                    raise
                errors[name] = e.short
                print(f"repeat {r + 1}/{repeats} {name}: failed ({e.short})", flush=True)
                continue
            print(f"repeat {r + 1}/{repeats} {name}: {times[name][-1]:.4f} s/microbatch", flush=True)
    split = split_backward(model, split_reps, timeout_s)
    median = {name: statistics.median(v) for name, v in times.items() if v}
    bound = median["pp1_m4"] / 2
    result = {
        "date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__, "model": model, "iters": iters, "warmup_iters": WARMUP_ITERS,
        "repeats": repeats,
        "command": "python -m bench.archive.throughput.torch_pipelining " + " ".join(argv if argv is not None else sys.argv[1:]),
        "s_per_microbatch": median, "runs": times,
        "efficiency": {name: bound / t for name, t in median.items() if name != "pp1_m4"},
        "errors": errors,
        "split_backward_overhead": split["overhead_autograd_grad"],
        "split_backward": split,
    }
    return emit(result, report(result), args.json)


def report(r: dict) -> str:
    """Markdown table of the medians and efficiencies, failed configurations and split-backward cost."""
    lines = ["| configuration | s / microbatch (median) | efficiency vs PP=1 / 2 |", "| --- | --- | --- |"]
    for name, t in r["s_per_microbatch"].items():
        eff = r["efficiency"].get(name)
        lines.append(f"| {name} | {t:.4f} | {'-' if eff is None else f'{100 * eff:.0f}%'} |")
    for name, message in r["errors"].items():
        lines.append(f"| {name} | failed: {message.splitlines()[0][:200]} | - |")
    s = r["split_backward"]
    lines.append("")
    lines.append(f"split backward on the PP=2 last stage (median of {s['reps']}): full {s['full'] * 1e3:.2f} ms; "
                 f"autograd.grad input {s['input'] * 1e3:.2f} + weight {s['weight'] * 1e3:.2f} ms "
                 f"(overhead {100 * s['overhead_autograd_grad']:+.0f}%); PipelineStage input "
                 f"{s['stage_input'] * 1e3:.2f} + weight {s['stage_weight'] * 1e3:.2f} ms "
                 f"(overhead {100 * s['overhead_pipeline_stage']:+.0f}%)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

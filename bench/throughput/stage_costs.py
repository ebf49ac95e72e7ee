"""Per-stage costs on CPU: a forward, a backward and an optimizer step on each stage.

The cost model (bench/throughput/project.py) and the simulator need what one microbatch costs
on each pipeline stage, measured on the same machine and in the same run as the
throughput they are to predict. Each stage of a Megatron-Core GPT (built as the
tests build it, `tests.support.tiny_gpt`) runs m microbatches then a step,
all stages at once so they share the machine as in a pipeline, but exchanging no
data; a ping-pong of one activation gives the one-way point-to-point latency.

    from bench.throughput.stage_costs import measure
    measure(model, reps=3)   # {"pp1": [stage], "pp2": [stage 0, stage 1]}
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the rank function must import as bench.throughput.stage_costs
    sys.path.insert(0, str(ROOT))


def stage_timing_rank(rank: int, world_size: int, spec, warmup: int, reps: int) -> dict:
    """Median forward and backward seconds of one microbatch and of one optimizer step on
    this stage, and the one-way p2p latency of an activation.

    All stages run at once (sharing the machine as in the pipeline) but exchange no
    data: stage s > 0 gets a random input, stages before the last a random output
    gradient. Each rep runs the batch's m microbatches and then the step, as the
    training loops do (a step between every two microbatches slows them by cooling
    the caches).
    """
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.utils import get_attr_wrapped_model

    from megatron_async.pipeline.grad_stats import make_stage_local
    from tests.support.forward_step import gpt_forward_step
    from tests.support.tiny_gpt import build, microbatches

    model, optimizer, _ = build(spec)
    from megatron.core.process_groups_config import ProcessGroupCollection

    make_stage_local(optimizer, False, ProcessGroupCollection.use_mpu_process_groups())
    chunk = model[0]
    first = parallel_state.is_pipeline_first_stage()
    last = parallel_state.is_pipeline_last_stage()
    set_input = get_attr_wrapped_model(chunk, "set_input_tensor")
    batches = list(microbatches(spec, 0))
    shape = (spec.seq_length, spec.micro_batch_size, spec.hidden_size)
    times = {"fwd": [], "bwd": [], "opt": []}
    for i in range(warmup + reps):
        dist.barrier()
        for batch in batches:
            set_input(None if first else torch.randn(shape, requires_grad=True))
            t0 = time.perf_counter()
            output, loss_func = gpt_forward_step(iter([batch]), chunk)
            if last:
                loss_sum, num_tokens, _ = loss_func(output)
                output = loss_sum / num_tokens
            t1 = time.perf_counter()
            torch.autograd.backward(output, grad_tensors=None if last else torch.randn_like(output))
            t2 = time.perf_counter()
            if i >= warmup:
                times["fwd"].append(t1 - t0)
                times["bwd"].append(t2 - t1)
        t2 = time.perf_counter()
        chunk.finish_grad_sync()
        optimizer.step()
        optimizer.zero_grad()
        chunk.zero_grad_buffer()
        if i >= warmup:
            times["opt"].append(time.perf_counter() - t2)
    result = {k: statistics.median(v) for k, v in times.items()}
    result["stage"] = parallel_state.get_pipeline_model_parallel_rank()
    if world_size > 1:  # ping-pong an activation between ranks 0 and 1
        x, rtt = torch.randn(shape), []
        for i in range(2 + 10):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(x, 1)
                dist.recv(x, 1)
            elif rank == 1:
                dist.recv(x, 0)
                dist.send(x, 0)
            if i >= 2:
                rtt.append(time.perf_counter() - t0)
        result["p2p"] = statistics.median(rtt) / 2
    return result


def make_spec(model: dict, schedule: str, pp: int, m: int):
    """A TinyGPT of the benchmark's sizes (keys as in bench/throughput/pipeline_throughput.py)."""
    from tests.support.tiny_gpt import TinyGPT

    return TinyGPT(pp=pp, schedule=schedule, global_batch_size=model["mbs"] * m, clip_grad=0.0,
                   num_layers=model["layers"], hidden_size=model["hidden"], num_attention_heads=model["heads"],
                   vocab_size=model["vocab"], seq_length=model["seq"], micro_batch_size=model["mbs"])


def measure(model: dict, reps: int = 3, m: int = 4, timeout_s: float = 900.0) -> dict:
    """Median per-stage costs (seconds) at PP=1 and PP=2: {"pp1": [...], "pp2": [...]}
    (PP=1 only for an odd number of layers, which has no even split)."""
    import importlib

    from tests.support.multiprocess import run_distributed

    rank_fn = importlib.import_module("bench.throughput.stage_costs").stage_timing_rank
    out = {}
    for key, pp in (("pp1", 1), ("pp2", 2))[:1 if model["layers"] % 2 else 2]:
        spec = make_spec(model, "no-pipelining" if pp == 1 else "1f1b", pp, m)
        ranks = run_distributed(rank_fn, pp, spec, 1, reps, timeout_s=timeout_s)
        out[key] = [{k: v for k, v in r.items() if k != "stage"} for r in ranks]
    return out


def median_costs(samples: list[dict]) -> dict:
    """Per-stage medians over several `measure` results."""
    return {key: [{k: statistics.median(run[key][s][k] for run in samples) for k in samples[0][key][s]}
                  for s in range(len(samples[0][key]))]
            for key in samples[0]}

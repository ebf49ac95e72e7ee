"""Host time of one transformer layer's forward and backward in Megatron-Core's eager code.

Whether CUDA graphs matter depends on whether the host issues a layer's kernels faster
than the GPU runs them. This counts what the host issues: the aten operators one layer
dispatches in a Megatron-Core GPT of the projected models' layer structure
(bench/throughput/project.py's `moe-10b`: RoPE, QK-norm, RMSNorm, SwiGLU experts, top-8
routing, the all-to-all dispatcher, its 64 experts over EP=8 as 8 local ones;
`smollm-360m`: RoPE, RMSNorm, SwiGLU, grouped-query attention 15/5) at sizes so small
that the arithmetic is negligible, on the CPU, one rank: a model of 4 layers against one
of 2, the difference halved (the embedding and the loss cancel). Megatron's local layers,
which this machine runs, dispatch more operators than Transformer Engine's fused ones,
so the counts are an upper bound for a TE run. It also times that layer here (the
fastest of `--reps`, CPU kernels of tiny tensors and the CPU emulation's dispatch
included) and a bare PyTorch operator on this CPU, for scale; a GPU node's host is a
different CPU, so project.py takes its time per operator as a stated assumption.

    .venv/bin/python -m bench.throughput.host_time --json out/bench/host_time.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the rank function must import as bench.throughput.host_time
    sys.path.insert(0, str(ROOT))

# the projected models' layer structure at negligible sizes (see the module docstring)
SHAPES = {
    "moe-10b": dict(hidden_size=64, num_attention_heads=16, kv_channels=4, qk_layernorm=True, num_moe_experts=8,
                    moe_router_topk=8, moe_ffn_hidden_size=32, moe_token_dispatcher_type="alltoall",
                    moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01),
    "smollm-360m": dict(hidden_size=60, num_attention_heads=15, num_query_groups=5, kv_channels=4,
                        ffn_hidden_size=160),
}


def _layer_host_time(rank: int, world_size: int, shape: str, reps: int) -> dict:
    import torch
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_async.planning.parallel import init_model_parallel

    torch.set_num_threads(1)
    init_model_parallel()
    fields = dict(SHAPES[shape])
    experts = fields.get("num_moe_experts")

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    def timings(layers: int) -> dict:
        config = TransformerConfig(num_layers=layers, normalization="RMSNorm", gated_linear_unit=True,
                                   activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0,
                                   attention_dropout=0.0, bias_activation_fusion=False, masked_softmax_fusion=False,
                                   bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
                                   gradient_accumulation_fusion=False, use_cpu_initialization=True, **fields)
        spec = get_gpt_layer_local_spec(num_experts=experts, qk_layernorm=config.qk_layernorm,
                                        normalization="RMSNorm")
        model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=16,
                         position_embedding_type="rope")
        tokens = torch.randint(0, 64, (1, 16))
        position_ids = torch.arange(16).unsqueeze(0)
        out = {"fwd": [], "bwd": []}
        for i in range(3 + reps):
            t0 = time.perf_counter()
            loss = model(tokens, position_ids, None, labels=tokens).sum()
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            if i >= 3:
                out["fwd"].append(t1 - t0)
                out["bwd"].append(t2 - t1)
        Count.ops = 0
        with Count():
            loss = model(tokens, position_ids, None, labels=tokens).sum()
            forward_ops = Count.ops
            loss.backward()
        return {"fwd": min(out["fwd"]), "bwd": min(out["bwd"]),
                "fwd_ops": forward_ops, "bwd_ops": Count.ops - forward_ops}

    four, two = timings(4), timings(2)  # the deeper first: Megatron's MoE metrics tracker keeps the first size
    return {key: (four[key] - two[key]) / 2 for key in two}


def bare_operator_seconds(reps: int = 5, n: int = 20000) -> float:
    """Host seconds of one tiny PyTorch operator on this CPU (the fastest of `reps` loops)."""
    import torch

    torch.set_num_threads(1)
    a = torch.randn(16, 8)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            a.add(a)
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def measure(reps: int = 30) -> dict:
    from tests.support.multiprocess import run_distributed

    return {shape: run_distributed(_layer_host_time, 1, shape, reps, timeout_s=600)[0] for shape in SHAPES}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    result = {"reps": args.reps, "bare_operator_s": bare_operator_seconds(), "per_layer": measure(args.reps)}
    print(f"a bare PyTorch operator: {1e6 * result['bare_operator_s']:.1f} us of host time on this CPU")
    for shape, r in result["per_layer"].items():
        print(f"{shape}: forward {1e6 * r['fwd']:.0f} us ({r['fwd_ops']:.0f} aten ops), "
              f"backward {1e6 * r['bwd']:.0f} us ({r['bwd_ops']:.0f} aten ops) of host time a layer")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()

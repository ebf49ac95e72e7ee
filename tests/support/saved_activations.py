"""Tensors a real Megatron-Core stage keeps for its backward, counted on the CPU, beside
the planner's figures for them (tests/test_plan_activations.py).

    python -m tests.support.saved_activations -- MEGATRON FLAGS...

Builds stages as the planner does (plan._build_stage: Megatron-Core's GPT model and local
layer spec, with the embedding and the output layer) with 1 and 2 layers, for each of
VARIANTS (selective and full recompute, attention dropout, an fp32 softmax), on the CPU
through the CUDA emulation. Each runs one microbatch's forward under torch's saved-tensor hooks; every
distinct storage autograd saved is counted once, however many views of it are saved.
Prints JSON: per case, the bytes of every saved storage that is not a parameter, the
saved storages shaped like one layer's attention scores (b x heads x s x s) and their
bytes, and the plan's activations and attention_scores terms for the same args. The norms' saved tensors differ between CPU and CUDA kernels, so the planner's
h-proportional terms are checked on a GPU instead (bench/gpu/moe_stage_memory.py).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import sys


VARIANTS = {  # settings on top of the command line's (which has no dropout and no recompute)
    "plain": {},
    "selective": {"recompute_granularity": "selective"},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    "attention dropout": {"attention_dropout": 0.1},
    "fp32 softmax": {"attention_softmax_in_fp32": True},
}


def _saved_scores(args, config, layers: int) -> dict:
    import torch

    from megatron_async.planning import plan

    model = plan._build_stage(config, args, layers, True, True, device="cpu")
    torch.manual_seed(0)
    for param in model.parameters():
        param.data.normal_(0, 0.02)
    model.to(torch.bfloat16 if args.bf16 else torch.float32).train()
    b, s = args.micro_batch_size, args.seq_length
    heads = args.num_attention_heads // args.tensor_model_parallel_size
    tokens = torch.randint(0, args.vocab_size, (b, s))
    positions = torch.arange(s).unsqueeze(0).expand(b, s)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    scores: dict[int, int] = {}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
            # a layer's scores, in any view (the value product saves them as b*heads x s x s)
            if tensor.dim() >= 3 and tuple(tensor.shape[-2:]) == (s, s) and tensor.numel() == b * heads * s * s:
                scores[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(tokens, positions, None, labels=tokens)
    loss.float().sum().backward()  # the graph ran whole: the counted tensors are ones it used
    return {"saved_bytes": sum(saved.values()), "score_storages": len(scores), "score_bytes": sum(scores.values())}


def cases(flags: list[str]) -> list[dict]:
    from megatron_async import cpu
    from megatron_async.check_flags import parse, prepare

    cpu.activate()
    prepare()
    import torch.distributed as dist

    from megatron_async.planning import plan

    with contextlib.redirect_stdout(io.StringIO()):
        parsed = parse(flags, 1, cpu_flags=True)
    parsed.padded_vocab_size = plan.padded_vocab_size(parsed)
    materialised = plan.materialises_scores(parsed)
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    out = []
    for variant, settings in VARIANTS.items():
        args = copy.copy(parsed)
        for name, value in {"recompute_granularity": None, "recompute_method": None, "recompute_num_layers": None,
                            "recompute_modules": None, **settings}.items():
            setattr(args, name, value)
        args, config = plan._plan_config(args)
        args = plan.settings_from_config(args, config)
        for layers in (1, 2):
            out.append({"variant": variant, "layers": layers, "materialised": materialised,
                        "plan_activations": plan.activation_bytes(args, 0, layers, True),
                        "plan_attention_scores": plan.attention_score_bytes(args, 0, layers, materialised),
                        **_saved_scores(args, config, layers)})
    return out


if __name__ == "__main__":
    argv = sys.argv[1:]
    print(json.dumps(cases(argv[1:] if argv[:1] == ["--"] else argv)))

"""A torch_dist checkpoint of the 10B MoE example's layer at any number of layers, written by
Megatron without holding the model in memory.

    python -m bench.export.file_backed_checkpoint OUT --layers N [--hidden 1024 --experts 32
        --moe-ffn 1024 --vocab 32000 --pool FILE]

Megatron's own arguments (parsed and validated as the launcher does for a GPU run: bf16,
untied, no CPU flags) describe the model; it is built on the meta device inside Megatron's
Float16Module as training wraps it (every weight bf16, the norms' too), and every weight
chunk of its sharded state dict, SwiGLU's gate and up halves apart as a save splits them,
becomes a private memory map of the start of one file of random bf16 values
(`torch.from_file`): the pages come from the page cache, one file's worth shared by every
weight, so this process holds that file, not the model.
Weights of one size hold the same values, which changes nothing an export does.
`dist_checkpointing.save` then writes them with the arguments, as `iter_0000001` with
Megatron's tracker file beside it.
"""

from __future__ import annotations

import argparse
import math
import os

ITERATION = 1


def megatron_flags(layers: int, hidden: int, experts: int, moe_ffn: int, vocab: int) -> list[str]:
    """The 10B example's layer (examples/moe_10b/flags.sh) at this size."""
    return ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(hidden // 128),
            "--seq-length", "4096", "--max-position-embeddings", "4096", "--position-embedding-type", "rope",
            "--rotary-base", "500000", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
            "--qk-layernorm", "--untie-embeddings-and-output-weights", "--num-experts", str(experts),
            "--moe-ffn-hidden-size", str(moe_ffn), "--moe-router-topk", "8", "--moe-router-load-balancing-type",
            "aux_loss", "--moe-aux-loss-coeff", "0.01", "--moe-token-dispatcher-type", "alltoall",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--bf16", "--micro-batch-size", "1",
            "--global-batch-size", "8", "--train-iters", "1", "--eval-iters", "0", "--eval-interval", "1", "--lr", "1e-4", "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab), "--ckpt-format", "torch_dist"]


def _pool(path: str, elements: int):
    """`path` holding at least `elements` random bf16 values (std 0.02), written once."""
    import torch

    if not os.path.isfile(path) or os.path.getsize(path) < elements * 2:
        values = (torch.randn(elements, dtype=torch.float32) * 0.02).to(torch.bfloat16)
        with open(path, "wb") as f:
            f.write(values.view(torch.uint8).numpy())


def write(out: str, flags: list[str], pool: str) -> int:
    """The checkpoint under `out`; returns the bytes of its model weights."""
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory, apply_factories
    from megatron.core.transformer.module import Float16Module

    from megatron_async.check_flags import parse, prepare
    from megatron_async.megatron_lm.export import megatron_model as mm
    from megatron_async.planning.plan import padded_vocab_size

    prepare()
    args = parse(flags, 1)
    args.padded_vocab_size = padded_vocab_size(args)
    mm.start_process_group()
    config = mm.model_config(mm.one_stage_args(args))
    with torch.device("meta"):
        model = Float16Module(config.transformer, mm.build_model(config))  # as Megatron's get_model wraps a bf16 run
    sharded = {k: v for k, v in model.sharded_state_dict().items() if isinstance(v, (ShardedTensor, ShardedTensorFactory))}
    apply_factories(sharded)
    chunks = [s for s in nested_values(sharded) if isinstance(s, ShardedTensor)]
    _pool(pool, max(math.prod(s.local_shape) for s in chunks))
    for chunk in chunks:
        chunk.data = torch.from_file(pool, shared=False, size=math.prod(chunk.local_shape),
                                     dtype=chunk.data.dtype).view(chunk.local_shape)
    directory = os.path.join(out, f"iter_{ITERATION:07d}")
    os.makedirs(directory)
    dist_checkpointing.save({"model": sharded, "args": args, "iteration": ITERATION, "checkpoint_version": 3.0},
                            directory)
    with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w", encoding="utf-8") as f:
        f.write(str(ITERATION))
    return sum(math.prod(s.local_shape) * s.data.element_size() for s in chunks)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--moe-ffn", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--pool", default=None, help="the random values' file (default: OUT.pool)")
    o = p.parse_args(argv)
    flags = megatron_flags(o.layers, o.hidden, o.experts, o.moe_ffn, o.vocab)
    model_bytes = write(o.out, flags, o.pool or o.out.rstrip("/") + ".pool")
    print(f"model_bytes {model_bytes}", flush=True)


if __name__ == "__main__":
    main()

"""Megatron command lines of the GPU acceptance suite's GPT runs, in one place.

A small GPT with Transformer Engine layers in bf16, mock data (Megatron's
arithmetic sequences, which a model learns in a few dozen steps, so a falling
loss is a real signal) and gradient-accumulation fusion left at Megatron's
default (on). Nothing here adds the CPU flags: on a GPU the launcher adds none.

`impl="local"` builds the same GPT from Megatron's local (non-TE) layers, for GPU
nodes without Transformer Engine: still CUDA, bf16 and NCCL, but without the three
kernels that come only with apex or Megatron's compiled extensions (masked softmax,
persistent layer norm, gradient-accumulation fusion), which Megatron would
otherwise fail to import at the first step.
"""

from __future__ import annotations


def gpt_flags(*, layers: int = 4, hidden: int = 256, heads: int = 8, seq: int = 256, micro_batch: int = 4,
              global_batch: int = 16, iters: int = 40, lr: float = 1e-3, seed: int = 1234,
              dropout: float = 0.0, impl: str = "transformer_engine") -> list[str]:
    """Model, precision, data and logging flags; add the layout and schedule flags."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {sorted(IMPLS)}, got {impl!r}")
    return [
        "--num-layers", layers, "--hidden-size", hidden, "--num-attention-heads", heads,
        "--seq-length", seq, "--max-position-embeddings", seq,
        "--micro-batch-size", micro_batch, "--global-batch-size", global_batch,
        "--untie-embeddings-and-output-weights", "--position-embedding-type", "learned_absolute",
        "--hidden-dropout", dropout, "--attention-dropout", dropout,
        *IMPLS[impl], "--bf16",
        "--train-iters", iters, "--lr", lr, "--min-lr", lr / 10, "--lr-decay-style", "cosine",
        "--seed", seed, "--log-interval", 1, "--eval-interval", 100000, "--eval-iters", 1,
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", 1024,
        "--num-workers", 0, "--rerun-mode", "disabled",
    ]


# Megatron's `--transformer-impl` and what each needs on a node with CUDA alone.
IMPLS = {
    "transformer_engine": ["--transformer-impl", "transformer_engine"],
    "local": ["--transformer-impl", "local", "--no-masked-softmax-fusion", "--no-persist-layer-norm",
              "--no-gradient-accumulation-fusion"],
}

MUON = ["--optimizer", "muon"]

# Four experts, two per rank at EP=2, routed by TE's grouped GEMM; the aux loss on.
MOE = ["--num-experts", 4, "--moe-router-topk", 2, "--expert-model-parallel-size", 2, "--moe-grouped-gemm",
       "--moe-token-dispatcher-type", "alltoall", "--moe-aux-loss-coeff", 1e-2, "--disable-bias-linear"]


def two_bw(stages: int) -> list:
    return ["--pipeline-model-parallel-size", stages, "--pipeline-schedule", "2bw"]


def simulated_twin(stages: int) -> list:
    """PP=1 at a one-step delay, clipped like `stages` pipeline stages: what 2bw must equal."""
    return ["--simulated-delay", 1, "--simulated-pipeline-stages", stages]

"""The planner's attention_scores term against Megatron-Core's own attention.

On the CPU: a stage built as the planner builds it (tests/support/saved_activations.py)
keeps one b x heads x s x s score tensor a layer for its backward with Megatron's local
attention, and none under `--recompute-granularity selective`; the plan's term grows by
exactly that much a layer in both cases, and with an fp32 softmax or attention dropout
too. Under full recompute a layer keeps only its input, and the plan's activations grow
by exactly that. The backward's working set and the global buffer
(a constant number of score tensors) and the h-proportional activation terms were read off
a GPU's allocator trace (bench/gpu/moe_stage_memory.py --breakdown-step; docs/benchmarks.md)."""

import json
from types import SimpleNamespace

import pytest
import torch
from megatron.core.transformer.enums import AttnBackend

from megatron_async.planning.plan import attention_score_bytes, materialises_scores, recompute_unit, recomputed_layers

FLAGS = ["--num-layers", "2", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255",
         "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "256",
         "--max-position-embeddings", "256", "--micro-batch-size", "1", "--train-iters", "2", "--eval-interval", "10",
         "--lr", "1e-3", "--bf16", "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
         "--disable-bias-linear", "--qk-layernorm", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--num-experts", "2", "--moe-ffn-hidden-size", "32", "--moe-router-topk", "2",
         "--moe-token-dispatcher-type", "alltoall", "--transformer-impl", "local"]


ELEMENTS = 1 * 4 * 256 * 256  # one layer's scores: b x heads x s x s of FLAGS


@pytest.fixture(scope="module")
def rows():
    from tests.support.warm_launch import warm_python

    proc = warm_python("tests.support.saved_activations", ["--", *FLAGS], 240)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return {(r["variant"], r["layers"]): r for r in json.loads(proc.stdout.strip().splitlines()[-1])}


def _per_layer(rows, variant, key):
    return rows[(variant, 2)][key] - rows[(variant, 1)][key]


def test_the_plan_counts_the_score_tensors_megatrons_local_attention_keeps_a_layer(rows):
    assert rows[("plain", 1)]["materialised"]
    kept = {}
    for variant in ("plain", "selective", "fp32 softmax"):
        kept[variant] = _per_layer(rows, variant, "score_bytes")
        assert _per_layer(rows, variant, "plan_attention_scores") == kept[variant], variant
    # bf16 softmax output; nothing when recomputed; an fp32 output and the bf16 copy the value
    # product keeps: a plan blind to recomputation or to the softmax's precision fails one of them
    assert kept == {"plain": 2 * ELEMENTS, "selective": 0, "fp32 softmax": (4 + 2) * ELEMENTS}


def test_with_attention_dropout_the_plan_counts_its_output_and_its_mask(rows):
    """The softmax output, the dropout's output and its mask. torch's CPU dropout keeps the mask
    in the input's dtype (bernoulli noise, 2 bytes); CUDA's fused kernel, which the plan counts,
    keeps a bool (1 byte): the CPU keeps one byte an element more."""
    measured = _per_layer(rows, "attention dropout", "score_bytes")
    assert measured == (2 + 2 + 2) * ELEMENTS
    assert _per_layer(rows, "attention dropout", "plan_attention_scores") == measured - (2 - 1) * ELEMENTS


def test_under_full_recompute_the_plan_counts_a_layers_input_alone(rows):
    layer_input = 2 * 64 * 256  # bf16 hidden states of one microbatch: the checkpoint's input
    assert _per_layer(rows, "full", "saved_bytes") == layer_input
    assert _per_layer(rows, "full", "plan_activations") == layer_input
    assert rows[("full", 2)]["score_storages"] == 0
    # without recompute a layer keeps far more, so a plan blind to full recompute would fail here
    assert _per_layer(rows, "plain", "saved_bytes") > 10 * layer_input


def _args(**over):
    base = dict(transformer_impl="transformer_engine", attention_backend=AttnBackend.auto, micro_batch_size=1,
                params_dtype=torch.bfloat16, attention_softmax_in_fp32=False, attention_dropout=0.0,
                num_attention_heads=16, tensor_model_parallel_size=1, seq_length=4096, recompute_granularity=None,
                recompute_modules=None, recompute_method=None, recompute_num_layers=None,
                pipeline_model_parallel_size=4)
    return SimpleNamespace(**{**base, **over})


@pytest.mark.parametrize("over, materialised", [
    ({}, False), ({"attention_backend": AttnBackend.flash}, False), ({"attention_backend": AttnBackend.fused}, False),
    ({"attention_backend": AttnBackend.unfused}, True), ({"transformer_impl": "local"}, True)])
def test_only_attention_that_materialises_scores_gets_the_term(over, materialised):
    args = _args(**over)
    assert materialises_scores(args) is materialised
    assert (attention_score_bytes(args, 1, 6, materialises_scores(args)) > 0) is materialised


def test_the_score_term_follows_tensor_parallelism_stage_and_recomputation():
    score = 2 * 16 * 4096**2  # bf16 bytes of one layer's scores
    assert attention_score_bytes(_args(), 1, 6, True) == score * (6 * 3 + 3 + 1)  # 3 microbatches in flight on stage 1
    assert attention_score_bytes(_args(tensor_model_parallel_size=2), 1, 6, True) == score // 2 * (6 * 3 + 3 + 1)
    assert attention_score_bytes(_args(recompute_granularity="selective"), 1, 6, True) == score * 5
    # recomputing other modules than core attention keeps the scores
    kept = _args(recompute_granularity="selective", recompute_modules=["mlp"])
    assert attention_score_bytes(kept, 1, 6, True) == attention_score_bytes(_args(), 1, 6, True)


@pytest.mark.parametrize("method, n, kept, checkpoints, unit", [
    ("uniform", 1, 0, 7, 1), ("uniform", 3, 0, 3, 3), ("uniform", 8, 0, 1, 7),
    ("block", 2, 5, 2, 1), ("block", 9, 0, 7, 1), ("block", 0, 7, 0, 0)])
def test_full_recompute_keeps_what_megatrons_checkpointed_forward_keeps(method, n, kept, checkpoints, unit):
    """megatron/core/recompute.py: `uniform` checkpoints chunks of n layers at their inputs and
    rebuilds a chunk at a time; `block` checkpoints the first n layers one by one."""
    args = _args(recompute_granularity="full", recompute_method=method, recompute_num_layers=n)
    assert recomputed_layers(args, 7) == (kept, checkpoints)
    assert recompute_unit(args, 7) == unit
    assert recomputed_layers(_args(), 7) == (7, 0) and recompute_unit(_args(), 7) == 0

"""Plan a run before it meets the cluster: parameters and memory per GPU of every stage.

    python -m megatron_async.planning.plan --world-size 32 [--gpu-gb 80] [--json PATH] -- ARGS...

Validates ARGS as the launcher would (megatron_async.check_flags), then builds each
pipeline stage of that exact model with Megatron-Core's GPT model and layer specs on
the meta device (no memory, no GPU): its layers, plus the embedding on the first
stage and the output layer on the last. Parameters split over tensor-parallel ranks
(and experts over expert-parallel ranks) are divided accordingly, which gives the
parameters each GPU holds. The memory budget per GPU, for a bf16 run under 2bw:

- weights (2 bytes a parameter) and the stash: one more copy under 2bw, K under
  --simulated-delay K, two with weight prediction (safety/save_space.stash_copies);
- gradients (Megatron's grad buffer: 4 bytes with --accumulate-allreduce-grads-in-fp32, else 2);
- optimizer state, sharded over the data-parallel ranks with --use-distributed-optimizer
  (experts over the expert-data-parallel ranks): fp32 main weights (4) and Adam's two
  moments (8) or Muon's momentum (4);
- the correction's buffers, fp32, sharded like the main weights: one copy with
  --delay-correction ef (the previous update) or nesterov (the previous gradient),
  two with dc-asgd (the previous update and the gradient's mean square);
- activations, an estimate: bytes a token a layer x tokens of a microbatch x layers of
  the stage x microbatches in flight (p - s on stage s under 1F1B and 2bw; 2(p - s) under 2bw
  with --overlap-moe-expert-parallel-comm, whose combined steps need a deeper warm-up,
  counted off its lists: planning/in_flight.py), plus the last stage's fp32 logits. A dense layer keeps 34h (Korthikanti et al. 2022, flash
  attention); an MoE layer keeps 20h outside its experts (measured with Megatron-Core's
  local layers, RoPE and QK-norm, no dropout: bench/gpu/moe_stage_memory.py
  --breakdown-step) and top-k experts' 2h + 6f (their input, SwiGLU's input and output).
  Under --recompute-granularity full a checkpointed chunk keeps only its input and the
  backward rebuilds one chunk (uniform) or one layer (block) at a time; selective
  recompute of modules other than core attention is counted as kept (an overestimate).
  Sequence and context parallelism are not divided out (an overestimate);
- attention_scores, with attention that materialises the s x s scores (Megatron's local
  DotProductAttention, --transformer-impl local or --attention-backend unfused/local; 0
  with flash or fused attention, which Transformer Engine's `auto` is taken to pick):
  per layer in flight, what its scores keep for the backward (the softmax output, with
  an fp32 softmax also the 16-bit copy the value product keeps, with attention dropout
  its output and its mask; none where selective recompute rebuilds core attention), a
  layer's backward working set of three more score tensors (four when recomputed), and
  Megatron's global score buffer, in elements of b x heads/TP x s^2;
- 2bw's point-to-point buffers: the tensors a stage has sent and holds until the
  sends retire after its next optimizer step, plus an output not yet posted and a
  receive not yet consumed, at their peak, counted exactly by replaying the 2bw
  action stream (planning/send_buffers.py), each of the activation shape in the pipeline dtype;
- with tied embeddings under 2bw, the link's buffers (pipeline/tied_embeddings.py):
  the first stage one gradient of the vocabulary x hidden weight (this rank's
  tensor-parallel shard), the last stage a copy of its gradient and a weight buffer.

`total` is the training peak, the sum of those terms' peaks. A checkpoint save under
2bw adds nothing on the GPU (`save_gpu` = 0): the torch format's per-rank file streams
the stash to host memory one flat buffer at a time (WeightStashManager.state_dict,
tests/test_stash_save.py), `save_host` bytes of host memory a rank, and torch_dist
saves the stash's own views. `save_total` = total + save_gpu is the peak budget during
a save. Prints a table and exits 1 if a stage's peak during a save does not fit in
--gpu-gb. Also prints the size of one checkpoint, which the run checks --save has room
for before training (megatron_lm/safety/save_space.py).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys

from megatron_async.megatron_lm.safety.save_space import CORRECTION_COPIES, stash_copies  # fp32 copies of the sharded main weights
from megatron_async.planning.in_flight import microbatches_in_flight, uses_combined_steps
from megatron_async.megatron_lm.adapter import run_mode


def _build_stage(config, args, layers: int, first: bool, last: bool, device: str = "meta"):
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    stage_config = copy.copy(config)
    stage_config.num_layers = layers
    # one stage built alone with exactly `layers` layers: no split of Megatron's to apply again
    for name in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
                 "pipeline_model_parallel_layout"):
        if hasattr(stage_config, name):
            setattr(stage_config, name, None)
    for name in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"):
        if hasattr(stage_config, name):
            setattr(stage_config, name, False)
    for name in ("pipeline_model_parallel_size", "tensor_model_parallel_size", "expert_model_parallel_size",
                 "expert_tensor_parallel_size"):
        setattr(stage_config, name, 1)
    stage_config.sequence_parallel = False
    stage_config.use_cpu_initialization = True
    stage_config.perform_initialization = False
    spec = get_gpt_layer_local_spec(args.num_experts, False, qk_layernorm=args.qk_layernorm,
                                    normalization=args.normalization)
    with torch.device(device):
        return GPTModel(stage_config, spec, args.padded_vocab_size, args.max_position_embeddings,
                        pre_process=first, post_process=last,
                        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                        position_embedding_type=args.position_embedding_type)


def _counts(model) -> dict:
    dense = expert = 0
    for name, param in model.named_parameters():
        if ".experts." in name:
            expert += param.numel()
        else:
            dense += param.numel()
    return {"dense": dense, "expert": expert}


# Megatron's TransformerConfig settles these from several flags (--moe-layer-recompute,
# --apply-query-key-layer-scaling, recompute_modules' default); the plan reads its values
CONFIG_SETTINGS = ("recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules",
                   "attention_softmax_in_fp32", "attention_dropout")


def settings_from_config(args, config):
    """`args` (a copy) with the config's settled values of CONFIG_SETTINGS."""
    args = copy.copy(args)
    for name in CONFIG_SETTINGS:
        setattr(args, name, getattr(config, name))
    return args


def _selective(args, module: str) -> bool:
    return args.recompute_granularity == "selective" and module in (args.recompute_modules or ["core_attn"])


def _layer_bytes_per_token(args) -> int:
    """Bytes a layer keeps a token (docstring); selective recompute of modules other than core
    attention (`moe`, `mlp`, ...) is not modelled: those are counted as kept, an overestimate."""
    if args.num_experts:
        f = args.moe_ffn_hidden_size or args.ffn_hidden_size
        return 20 * args.hidden_size + args.moe_router_topk * (2 * args.hidden_size + 6 * f)
    return 34 * args.hidden_size


def recomputed_layers(args, layers: int) -> tuple[int, int]:
    """(layers kept whole, checkpoints) of a stage under Megatron's full recompute
    (megatron/core/recompute.py): `uniform` checkpoints each chunk of --recompute-num-layers
    layers at its input, `block` the first --recompute-num-layers layers one by one and keeps
    the rest; without full recompute every layer is kept."""
    if args.recompute_granularity != "full":
        return layers, 0
    n = args.recompute_num_layers
    if args.recompute_method == "uniform":
        return 0, -(-layers // n)
    recomputed = min(n, layers)
    return layers - recomputed, recomputed


def recompute_unit(args, layers: int) -> int:
    """Layers whose activations a full recompute rebuilds at once in the backward (0: none)."""
    if args.recompute_granularity != "full":
        return 0
    return min(args.recompute_num_layers, layers) if args.recompute_method == "uniform" \
        else min(1, args.recompute_num_layers, layers)


def activation_bytes(args, stage: int, layers: int, last: bool, in_flight: int | None = None) -> float:
    """The `activations` term of a stage (module docstring), for args settled by settings_from_config;
    `in_flight`: the stage's microbatches in flight (planning/in_flight.py; default p - stage)."""
    from megatron_async.planning.send_buffers import activation_tensor_bytes

    tokens = args.seq_length * args.micro_batch_size
    per_layer = _layer_bytes_per_token(args) * tokens
    kept, checkpoints = recomputed_layers(args, layers)
    if in_flight is None:
        in_flight = args.pipeline_model_parallel_size - stage
    # a checkpoint keeps its chunk's input (the hidden states a stage would send); the backward
    # rebuilds one unit at a time
    total = (kept * per_layer + checkpoints * activation_tensor_bytes(args)) * in_flight
    total += recompute_unit(args, layers) * per_layer
    if last:
        total += 4 * tokens * args.padded_vocab_size
    return total


def materialises_scores(args) -> bool:
    """Whether the run's attention keeps s x s scores: Megatron's local DotProductAttention, or an
    unfused backend asked for by name. Transformer Engine's `auto` counts as flash or fused
    attention (none kept), which TE picks wherever they support the shape and mask."""
    backend = getattr(getattr(args, "attention_backend", None), "name", str(getattr(args, "attention_backend", "")))
    return args.transformer_impl == "local" or backend in ("unfused", "local")


def score_element_bytes(args) -> tuple[int, int]:
    """(bytes an element of one layer's s x s scores keeps for the backward, bytes an element
    of the backward's working tensors): the softmax output (fp32 with
    --attention-softmax-in-fp32), the 16-bit copy the value product keeps when the softmax
    ran in fp32, and with attention dropout its output and its mask (CUDA's fused dropout
    keeps a bool mask). Measured on a GPU for a bf16 softmax without dropout; the rest is
    what Megatron's code keeps (tests/test_plan_activations.py counts it on the CPU)."""
    dtype = args.params_dtype.itemsize
    softmax = 4 if args.attention_softmax_in_fp32 else dtype
    dropout = args.attention_dropout > 0
    return softmax + (dtype if dropout or softmax != dtype else 0) + (1 if dropout else 0), softmax


def attention_score_bytes(args, stage: int, layers: int, materialised: bool, in_flight: int | None = None) -> float:
    """What attention that materialises the scores adds beyond `activations` (docstring): per
    layer in flight what its scores keep (score_element_bytes) unless core attention is
    recomputed, then one layer's backward working set (3 score tensors, 4 when recomputed)
    and Megatron's global score buffer, in elements of b x heads/TP x s^2."""
    if not materialised or not layers:
        return 0
    elements = args.micro_batch_size * args.num_attention_heads // args.tensor_model_parallel_size \
        * args.seq_length ** 2
    kept_bytes, softmax_bytes = score_element_bytes(args)
    recomputed = _selective(args, "core_attn")
    if in_flight is None:
        in_flight = args.pipeline_model_parallel_size - stage
    kept, _ = recomputed_layers(args, layers)
    stored = 0 if recomputed else kept * in_flight + recompute_unit(args, layers)  # full: the unit rebuilt
    working = (3 + (1 if recomputed else 0)) * softmax_bytes
    return elements * (stored * kept_bytes + working + args.params_dtype.itemsize)  # + the global buffer


def padded_vocab_size(args) -> int:
    """Megatron's padding of the vocabulary (to --make-vocab-size-divisible-by x TP), from
    --vocab-size (+1 for NullTokenizer's end of document), without loading a tokenizer."""
    if args.vocab_size is None:
        raise SystemExit("megatron_async.planning.plan: give --vocab-size (the tokenizer's vocabulary size)")
    vocab = args.vocab_size + (1 if args.tokenizer_type == "NullTokenizer" else 0)
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return -(-vocab // multiple) * multiple


def tied_link_bytes(args, first: bool, last: bool, grad_bytes: int) -> int:
    """Bytes a GPU holds for the tied-embedding link under 2bw: the first stage a received
    gradient, the last stage a gradient copy and the received weights (bf16), of the
    vocabulary x hidden weight's tensor-parallel shard; 0 untied, at PP=1, or between."""
    if args.untie_embeddings_and_output_weights or args.pipeline_model_parallel_size == 1 or first == last:
        return 0
    shard = padded_vocab_size(args) * args.hidden_size // args.tensor_model_parallel_size
    return grad_bytes * shard if first else (grad_bytes + 2) * shard


def _plan_config(args):
    """(args, Megatron's TransformerConfig) for building stages on the meta device: Megatron-Core's
    local layer spec (same parameters as Transformer Engine's); fused kernels change no
    parameter and need CUDA, so they are off here."""
    from megatron.training.argument_utils import core_transformer_config_from_args

    from megatron_async.planning.parallel import init_model_parallel

    import torch.distributed as dist

    if not dist.is_initialized():  # one process stands for a rank of each stage in turn
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    init_model_parallel(1, 1, 1, seed=args.seed)
    args = copy.copy(args)
    for name in ("apply_rope_fusion", "masked_softmax_fusion", "bias_gelu_fusion", "bias_swiglu_fusion",
                 "bias_dropout_fusion", "gradient_accumulation_fusion", "persist_layer_norm"):
        setattr(args, name, False)
    args.transformer_impl, args.no_persist_layer_norm = "local", True
    return args, core_transformer_config_from_args(args)


def layer_shape(args):
    """One transformer layer of this run, built on the meta device: what the cost model reads."""
    from megatron_async.planning.balance import LayerShape

    args, config = _plan_config(args)
    model = _build_stage(config, args, 1, False, False)
    counts = _counts(model)
    topk = args.moe_router_topk if args.num_experts else 1
    matrices = tuple((p.shape[0], p.shape[1], ".experts." in name) for name, p in model.named_parameters()
                     if p.dim() == 2)
    return LayerShape(active_params=int(counts["dense"] + counts["expert"] * topk / (args.num_experts or 1)),
                      matrices=matrices, params=counts["dense"] + counts["expert"], expert_params=counts["expert"])


def plan(args) -> list[dict]:
    """One row per pipeline stage: parameters of the stage and of one GPU, memory in GB."""
    from megatron_async.planning.send_buffers import activation_tensor_bytes, stage_peaks, stage_peaks_on_completion

    materialised = materialises_scores(args)  # read before _plan_config turns every run to the local spec
    args, config = _plan_config(args)
    args = settings_from_config(args, config)
    p, tp, ep = args.pipeline_model_parallel_size, args.tensor_model_parallel_size, args.expert_model_parallel_size
    dp = args.data_parallel_size
    expert_dp = max(dp * tp // (ep * (args.expert_tensor_parallel_size or tp)), 1)
    from megatron_async.planning.balance import layers_per_stage

    per_stage = layers_per_stage(args.num_layers, p, getattr(args, "decoder_first_pipeline_num_layers", None),
                                 getattr(args, "decoder_last_pipeline_num_layers", None),
                                 getattr(args, "pipeline_model_parallel_layout", None))
    grad_bytes = 4 if args.accumulate_allreduce_grads_in_fp32 else 2
    moments = 4 if "muon" in args.optimizer else 8
    two_bw = run_mode.of(args).spec.runtime is not None  # 2bw's runner: its sends, tied link
    m = args.global_batch_size // (args.micro_batch_size * dp)  # microbatches a batch, per data-parallel rank
    paired = uses_combined_steps(args)  # --overlap-moe-expert-parallel-comm: the deeper warm-up's lists
    in_flight = microbatches_in_flight(args, m)
    p2p = stage_peaks(p, m, paired=paired) if two_bw else None
    on_completion = stage_peaks_on_completion(p, m, paired=paired) if two_bw else None
    tensor_bytes = activation_tensor_bytes(args)
    tied = not args.untie_embeddings_and_output_weights
    rows = []
    for stage in range(p):
        first, last = stage == 0, stage == p - 1
        counts = _counts(_build_stage(config, args, per_stage[stage], first, last))
        gpu_dense = counts["dense"] / tp
        gpu_expert = counts["expert"] / (ep * (args.expert_tensor_parallel_size or tp))
        gpu = gpu_dense + gpu_expert
        sharded = gpu_dense / dp + gpu_expert / expert_dp if args.use_distributed_optimizer else gpu
        memory = {
            "weights": 2 * gpu,
            "stash": 2 * gpu * stash_copies(args),
            "gradients": grad_bytes * gpu,
            "optimizer": (4 + moments) * sharded,
            "ef_buffer": 4 * sharded * CORRECTION_COPIES.get(args.delay_correction, 0),
            "activations": activation_bytes(args, stage, per_stage[stage], last, in_flight[stage]),
            "attention_scores": attention_score_bytes(args, stage, per_stage[stage], materialised, in_flight[stage]),
            "p2p_buffers": p2p[stage].buffers * tensor_bytes if two_bw else 0,
            "tied_link": tied_link_bytes(args, first, last, grad_bytes) if two_bw else 0,
        }
        save_gpu, save_host = 0, memory["stash"]  # state_dict() streams every stash slot to the host
        total = sum(memory.values())
        tied_copy = args.padded_vocab_size * args.hidden_size if tied and last and not first else 0
        rows.append({"stage": stage, "layers": per_stage[stage], "in_flight": in_flight[stage],
                     "stage_params": counts["dense"] + counts["expert"],
                     "stage_expert_params": counts["expert"], "gpu_params": gpu,
                     "tied_copy_params": tied_copy,  # the last stage's copy of the tied embeddings
                     "memory_gb": {k: v / 2**30 for k, v in memory.items()},
                     "total_gb": total / 2**30,
                     "save_gpu_gb": save_gpu / 2**30, "save_host_gb": save_host / 2**30,
                     "save_total_gb": (total + save_gpu) / 2**30,
                     "p2p": {**dataclasses.asdict(p2p[stage]), "tensor_bytes": tensor_bytes,
                             "sends_on_completion": on_completion[stage].sends} if two_bw else None})
    return rows


def _print_table(rows: list[dict]) -> None:
    keys = list(rows[0]["memory_gb"])
    print("| stage | params/GPU | " + " | ".join(f"{k} GB" for k in keys)
          + " | total GB (training peak) | save_gpu GB | save_host GB | total GB during a save |")
    print("|" + " --- |" * (len(keys) + 6))
    for r in rows:
        print(f"| {r['stage']} | {r['gpu_params'] / 1e9:.3f}B | "
              + " | ".join(f"{r['memory_gb'][k]:.1f}" for k in keys)
              + f" | {r['total_gb']:.1f} | {r['save_gpu_gb']:.1f} | {r['save_host_gb']:.1f} | {r['save_total_gb']:.1f} |")
    for r in rows:
        if r["p2p"]:
            c = r["p2p"]
            print(f"stage {r['stage']} p2p_buffers: at most {c['act_sends']} activation and {c['grad_sends']} "
                  f"gradient sends held, {c['sends']} at once; {c['buffers']} buffers at the peak "
                  f"x {c['tensor_bytes'] / 2**20:.1f} MiB; on NCCL, where a finished send retires at the next "
                  f"post, a balanced pipeline holds {c['sends_on_completion']} sends at once")


def balance(args, rows: list[dict]) -> dict | None:
    """Where the run's split stands against the best split of whole layers (the cost model's
    seconds a microbatch on the reference cluster), and Megatron's flags for that split."""
    from megatron_async.planning.balance import cost_model, megatron_flags

    if len(rows) < 2:
        return None
    model = cost_model(args, layer_shape(args))
    best = model.best(len(rows), first_and_last_only=bool(args.mtp_num_layers))
    used = [r["layers"] for r in rows]
    now = model.stage_costs(used)
    try:
        flags = megatron_flags(best.layers, bool(args.mtp_num_layers))
    except ValueError as err:
        flags = [f"(not expressible: {err})"]
    return {"used": used, "used_costs": list(now), "used_imbalance": max(now) / (sum(now) / len(now)) - 1,
            "best": list(best.layers), "best_costs": list(best.stage_costs), "best_imbalance": best.imbalance,
            "predicted_gain": max(now) / best.slowest, "flags": flags, "terms": model.terms}


def _print_balance(found: dict | None) -> None:
    if not found:
        return
    flags = " ".join(found["flags"]) or "(Megatron's even split)"
    print(f"stage balance: this split {found['used']} puts the slowest stage {100 * found['used_imbalance']:.0f}% "
          f"above a perfect balance; the best whole-layer split {found['best']} puts it "
          f"{100 * found['best_imbalance']:.0f}% above: {flags}")


def fits_on_gpu(rows: list[dict], gpu_gb: float) -> bool:
    """Every stage fits in `gpu_gb`, during a checkpoint save too (the stash's clone)."""
    return all(r["save_total_gb"] <= gpu_gb for r in rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--gpu-gb", type=float, default=80.0, help="memory of one GPU (GiB)")
    parser.add_argument("--json", default=None)
    parser.add_argument("args", nargs=argparse.REMAINDER, help="-- then the training command line")
    ns = parser.parse_args(argv)
    train_args = ns.args[1:] if ns.args[:1] == ["--"] else ns.args
    from megatron_async.planning.quiet_notices import silence_known_notices

    silence_known_notices()  # before Megatron's imports: the table comes first

    from megatron_async.check_flags import parse, prepare

    prepare()
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):  # Megatron prints every argument
        args = parse(train_args, ns.world_size)
    args.padded_vocab_size = padded_vocab_size(args)
    rows = plan(args)
    total = sum(r["stage_params"] - r["tied_copy_params"] for r in rows)  # a tied weight counts once
    topk = args.moe_router_topk if args.num_experts else 1
    experts = sum(r["stage_expert_params"] for r in rows)
    active = total - experts + experts * topk / (args.num_experts or 1)
    print(f"model: {total / 1e9:.2f}B parameters, {active / 1e9:.2f}B active per token; "
          f"PP={args.pipeline_model_parallel_size} TP={args.tensor_model_parallel_size} "
          f"EP={args.expert_model_parallel_size} DP={args.data_parallel_size} on {ns.world_size} GPUs")
    _print_table(rows)
    warm_up = (" (2bw's deeper warm-up for --overlap-moe-expert-parallel-comm's combined steps)"
               if uses_combined_steps(args) else "")
    print(f"activations: {', '.join(str(r['in_flight']) for r in rows)} microbatches in flight on stages "
          f"0..{len(rows) - 1}{warm_up}")
    found = balance(args, rows)
    _print_balance(found)
    from megatron_async.megatron_lm.safety.save_space import bytes_per_parameter

    checkpoint_gb = total * bytes_per_parameter(args) / 2**30  # what --save must have free (safety/save_space.py)
    print(f"one checkpoint: about {checkpoint_gb:.1f} GB ({bytes_per_parameter(args)} bytes a parameter)")
    fits = fits_on_gpu(rows, ns.gpu_gb)
    print(f"every stage fits in {ns.gpu_gb:g} GB, during a save too" if fits
          else f"a stage exceeds {ns.gpu_gb:g} GB (in training or during a save)")
    if ns.json:
        with open(ns.json, "w", encoding="utf-8") as f:
            json.dump({"total_params": total, "active_params": active, "padded_vocab_size": args.padded_vocab_size,
                       "gpu_gb": ns.gpu_gb, "fits": fits, "checkpoint_gb": checkpoint_gb,
                       "stages": rows, "balance": found}, f, indent=1)
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main())

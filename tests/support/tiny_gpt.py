"""A tiny Megatron-Core GPT with any TP/PP/EP/DP layout, for multi-rank tests.

Everything is built with Megatron-Core's GPT model and parallel groups (`tests.support.model`,
`megatron_async.planning.parallel`) and Megatron's DDP and optimizer; only the sizes are
tiny and the data is seeded random tokens, identical on every rank, so runs with
different layouts see the same global batches and can be compared.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_async.megatron_lm.adapter import layout_invariant_init
from megatron_async.planning.parallel import init_model_parallel
from megatron_async.schedules.registry import get_forward_backward_func, schedule_or_default
from megatron_async.stash.delay_reference import version_for_step
from tests.support.forward_step import gpt_forward_step, reduce_lm_loss
from tests.support.model import attach_schedule_hooks, build_gpt_chunks, moe_settings, wrap_ddp


@dataclass
class TinyGPT:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    num_layers: int = 2
    hidden_size: int = 32
    num_attention_heads: int = 4
    vocab_size: int = 64
    seq_length: int = 16
    micro_batch_size: int = 2
    global_batch_size: int = 8
    num_experts: Optional[int] = None
    moe_router_topk: int = 2
    moe_token_dispatcher_type: str = "alltoall"
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    optimizer: str = "adam"
    lr: float = 1e-2
    clip_grad: float = 1.0
    seed: int = 1234
    schedule: Optional[str] = None  # default: no-pipelining for PP=1, 1f1b otherwise; or "2bw"
    simulated_delay: int = 0  # K > 0: gradients at the weights of K steps ago (PP=1 reference for 2bw)
    stage_delays: tuple = ()  # PP=1: one delay per would-be stage instead (layers split evenly)
    init_by_name: bool = False  # layout-independent init, so different PP/TP layouts start equal
    clip_stages: int = 1  # PP=1 only: clip like a pipeline of this many stages (stage-local norms)
    clip_grad_mode: str = "stage-local"  # 2bw: or "stale-global"
    planned_iterations: Optional[int] = None  # 2bw: the run planned this many and stops early (--exit-interval)
    weight_prediction: Optional[float] = None  # run microbatches at W + alpha (W - W_prev) (one-step delay only)
    gradient_accumulation_fusion: bool = True  # Megatron's default: fused wgrad accumulation into main_grad
    te_like: Optional[str] = None  # a te_like kernel kind on every local linear layer (tests/support/te_like.py)
    te_like_honours_switch: bool = True  # False: the kernel ignores disable_parameter_transpose_cache
    stash_alias_guard: bool = True  # the weight stash refuses saved aliases of a weight (guard_aliases)
    extra_optimizer_config: dict = field(default_factory=dict)

    def dp(self, world_size: int) -> int:
        return world_size // (self.tp * self.pp)

    def num_microbatches(self, world_size: int) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp(world_size))


def transformer_config(spec: TinyGPT) -> TransformerConfig:
    moe = moe_settings(spec.num_experts, spec.moe_router_topk, spec.moe_token_dispatcher_type)
    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        tensor_model_parallel_size=spec.tp,
        pipeline_model_parallel_size=spec.pp,
        expert_model_parallel_size=spec.ep,
        sequence_parallel=False,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=spec.gradient_accumulation_fusion,
        **moe,
    )


def build(spec: TinyGPT):
    """(model chunks wrapped in DDP, optimizer, transformer config) on this rank."""
    init_model_parallel(spec.tp, spec.pp, spec.ep, seed=spec.seed)
    config = transformer_config(spec)
    chunks = build_gpt_chunks(config, spec.vocab_size, spec.seq_length, share_embeddings_and_output_weights=False)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=spec.use_distributed_optimizer,
        overlap_grad_reduce=spec.overlap_grad_reduce,
    )
    model = wrap_ddp(chunks, config, ddp_config)
    if spec.te_like is not None:
        from tests.support import te_like

        te_like.install(model, spec.te_like, honour_switch=spec.te_like_honours_switch)
    if spec.init_by_name:
        init_by_global_name(model, spec)
    if spec.clip_stages > 1:
        from megatron_async.pipeline.grad_stats import clip_like_pipeline_stages

        clip_like_pipeline_stages(model, spec.num_layers, spec.clip_stages)
    opt_config = OptimizerConfig(
        optimizer=spec.optimizer,
        lr=spec.lr,
        weight_decay=0.0,
        clip_grad=spec.clip_grad,
        use_distributed_optimizer=spec.use_distributed_optimizer,
        **spec.extra_optimizer_config,
    )
    optimizer = get_megatron_optimizer(opt_config, model)
    attach_schedule_hooks(config, model, optimizer)
    return model, optimizer, config


def _tiny_values(name: str, shape: list, gen: torch.Generator) -> torch.Tensor:
    """Every tensor random (biases too, so each one is exercised), layer norms around 1."""
    full = torch.randn(shape, generator=gen) * 0.05
    if "layernorm" in name and name.endswith("weight"):
        full += 1.0
    return full


def init_by_global_name(model, spec: TinyGPT) -> None:
    """Every weight drawn from a generator seeded by its global name, then TP-sharded."""
    layout_invariant_init.init_by_global_name(model, spec.seed, _tiny_values)


def global_batch(spec: TinyGPT, iteration: int) -> torch.Tensor:
    """Token ids [global_batch_size, seq_length + 1], the same on every rank.

    Tokens follow a learnable rule (next = previous + 1 mod vocab, with noise) so
    the loss visibly falls within a few steps.
    """
    gen = torch.Generator().manual_seed(spec.seed * 1000 + iteration)
    start = torch.randint(0, spec.vocab_size, (spec.global_batch_size, 1), generator=gen)
    ramp = torch.arange(spec.seq_length + 1).unsqueeze(0)
    tokens = (start + ramp) % spec.vocab_size
    noise = torch.rand(tokens.shape, generator=gen) < 0.1
    random_tokens = torch.randint(0, spec.vocab_size, tokens.shape, generator=gen)
    return torch.where(noise, random_tokens, tokens)


def microbatches(spec: TinyGPT, iteration: int) -> Iterator[dict]:
    """This data-parallel rank's microbatches of the global batch."""
    dp_size = parallel_state.get_data_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    tokens = global_batch(spec, iteration)
    per_rank = spec.global_batch_size // dp_size
    local = tokens[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    for start in range(0, per_rank, spec.micro_batch_size):
        chunk = local[start : start + spec.micro_batch_size]
        yield {"tokens": chunk[:, :-1].contiguous(), "labels": chunk[:, 1:].contiguous()}


def microbatch_getter(spec: TinyGPT, num_microbatches: int):
    """get(k) -> microbatch k (batch k // m, position k % m) of this data-parallel rank."""
    cache: dict[int, list] = {}

    def get(k: int) -> dict:
        batch = k // num_microbatches
        if batch not in cache:
            cache.clear()
            cache[batch] = list(microbatches(spec, batch))
        return cache[batch][k % num_microbatches]

    return get


def full_named_params(model, spec: Optional[TinyGPT] = None) -> dict[str, torch.Tensor]:
    """This stage's parameters with tensor-parallel shards gathered, by name (cloned)."""
    out = {}
    group = parallel_state.get_tensor_model_parallel_group()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    for index, chunk in enumerate(model):
        names = layout_invariant_init.global_param_names(chunk)
        for name, param in layout_invariant_init.innermost_module(chunk).named_parameters():
            data = param.detach().clone()
            if tp > 1 and getattr(param, "tensor_model_parallel", False):
                parts = [torch.empty_like(data) for _ in range(tp)]
                dist.all_gather(parts, data.contiguous(), group=group)
                data = torch.cat(parts, dim=param.partition_dim)
            key = names[name] if spec is not None else f"{index}.{name}"
            out[key] = data
    return out


def _dp_mean(loss: Optional[float]) -> Optional[float]:
    if loss is None:
        return None
    t = torch.tensor([loss], dtype=torch.float64)
    dist.all_reduce(t, group=parallel_state.get_data_parallel_group())
    return t.item() / parallel_state.get_data_parallel_world_size()


def _grads_present(model) -> bool:
    return all(
        p.main_grad is not None and bool(torch.isfinite(p.main_grad).all()) and float(p.main_grad.abs().sum()) > 0
        for chunk in model for p in chunk.parameters() if p.requires_grad
    )


def train(spec: TinyGPT, iterations: int, rank: int, world_size: int) -> dict[str, Any]:
    """Train `iterations` steps; return losses (last stage), grad flags and final weights."""
    from megatron_async.pipeline.grad_stats import make_stage_local
    from megatron_async.pipeline.stage_context import stage_context
    from megatron_async.stash.weight_stash import WeightStashManager
    from tests.support.two_bw_trainer import SelfSteppingRunner, microbatch_data

    model, optimizer, config = build(spec)
    schedule = spec.schedule or ("1f1b" if spec.pp > 1 else "no-pipelining")
    num_micro = spec.num_microbatches(world_size)
    losses, grads_present, extra = [], [], {}
    two_bw = schedule_or_default(schedule)
    if two_bw.runtime is not None:
        groups = ProcessGroupCollection.use_mpu_process_groups()
        make_stage_local(optimizer, spec.use_distributed_optimizer, groups)
        assert len(model) == 1, "2bw runs one model chunk per stage (no virtual pipeline stages)"
        stash = WeightStashManager(model, depth=two_bw.stash_copies, predict=spec.weight_prediction,
                                   guard_aliases=spec.stash_alias_guard)
        context = stage_context(model[0], stash, gpt_forward_step, num_micro,
                                (spec.seq_length, spec.micro_batch_size, spec.hidden_size), torch.float32, groups)
        stale_norm = None
        if spec.clip_grad_mode == "stale-global":
            from megatron_async.pipeline.p2p import duplicate_pipeline_group
            from megatron_async.pipeline.stale_global import StaleGlobalNorm

            stale_norm = StaleGlobalNorm(duplicate_pipeline_group(groups.pp, backend="gloo"))
        runner = SelfSteppingRunner(context, two_bw.stream_for, optimizer, spec.planned_iterations or iterations,
                                    stale_norm=stale_norm)
        data_for = microbatch_data(microbatch_getter(spec, num_micro))
        for iteration in range(iterations):
            reports, (update_ok, _norm, _) = runner.train_step(iteration, data_for)
            assert update_ok, f"optimizer step {iteration} was skipped"
            losses.append(_dp_mean(reduce_lm_loss(reports)))
            grads_present.append(True)
        extra["pending_sends"] = runner.pending_sends
        runner.finish()
        extra["forwards"] = runner.executor.forwards
        extra["weight_buffers"] = runner.stash.num_weight_buffers()
        extra["stash_bytes"] = runner.stash.stash_bytes()
        extra["live_bytes"] = runner.stash.live_bytes()
        if runner.stale_norm:
            extra["norm_used"], extra["norm_local"] = list(runner.stale_norm.used), list(runner.stale_norm.local)
        return _result(spec, model, losses, grads_present, rank, extra)

    forward_backward = get_forward_backward_func(schedule)
    delays = spec.stage_delays or (spec.simulated_delay,)
    stash = (WeightStashManager(model, depth=max(delays), predict=spec.weight_prediction,
                                guard_aliases=spec.stash_alias_guard) if max(delays) else None)
    version = version_for_step(model, stash, delays, spec.num_layers) if stash else None
    for iteration in range(iterations):
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        # as SimulatedDelayRun: the whole batch runs between two steps, so no saved-tensor hooks
        with (stash.use(version(iteration), hooks=False) if stash else contextlib.nullcontext()):
            reduced = forward_backward(
                forward_step_func=gpt_forward_step,
                data_iterator=microbatches(spec, iteration),
                model=model,
                num_microbatches=num_micro,
                seq_length=spec.seq_length,
                micro_batch_size=spec.micro_batch_size,
                forward_only=False,
            )
        grads_present.append(_grads_present(model))
        with (stash.optimizer_step() if stash else contextlib.nullcontext()):
            update_ok, grad_norm, _ = optimizer.step()
        assert update_ok, f"optimizer step {iteration} was skipped"
        losses.append(_dp_mean(reduce_lm_loss(reduced)))
    return _result(spec, model, losses, grads_present, rank, extra)


def _result(spec, model, losses, grads_present, rank, extra) -> dict[str, Any]:
    return {
        "rank": rank,
        "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        "dp_rank": parallel_state.get_data_parallel_rank(),
        "losses": losses,
        "grads_present": grads_present,
        "params": full_named_params(model, spec if spec.init_by_name else None),
        "spec": dataclasses.asdict(spec),
        **extra,
    }


def train_entry(rank: int, world_size: int, spec: TinyGPT, iterations: int) -> dict[str, Any]:
    """Entry point for `run_distributed` (module-level, so it pickles)."""
    return train(spec, iterations, rank, world_size)

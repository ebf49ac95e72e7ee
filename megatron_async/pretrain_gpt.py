"""`megatron-async-pretrain`: pretrain a Megatron-Core GPT, launched with torchrun.

    torchrun --nproc-per-node 2 -m megatron_async.pretrain_gpt \
        --pipeline-model-parallel-size 2 --train-data-path data/train_text_document ...

Flags carry Megatron-LM's names (see `--help`). Bad flags are refused before any
process group is created, on every rank, with a message naming the flag.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Optional, Sequence

import torch


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _fail(message: str) -> int:
    print(f"megatron-async-pretrain: error: {message}", file=sys.stderr, flush=True)
    return 2


def _init_distributed(device: str) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.distributed.init_process_group(
        "nccl" if device == "cuda" else "gloo", timeout=timedelta(minutes=10)
    )


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    multiple = divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple


def main(argv: Optional[Sequence[str]] = None) -> int:
    from megatron_async.training.arguments import ArgumentError, check_data_files, parse_args, validate_args

    from megatron_async.launcher_watch import exit_with_launcher

    exit_with_launcher()
    args = parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        validate_args(args, world_size)
        check_data_files(args)  # datasets vs tokenizer and batch size (data/checks.py)
        from megatron_async import cpu

        device = cpu.setup_device(args.device)
    except (ArgumentError, RuntimeError) as err:
        return _fail(str(err))
    if device == "cpu":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    args.params_dtype = torch.bfloat16 if args.bf16 else torch.float32

    _init_distributed(device)
    from megatron_async.pipeline.non_finite import NonFiniteError

    try:
        return _train(args, device)
    except NonFiniteError as err:
        print(f"megatron-async-pretrain: rank {_rank()}: stopped: {err}", file=sys.stderr, flush=True)
        return 3
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _train(args, device: str) -> int:
    from megatron_async.model import attach_schedule_hooks
    from megatron_async.parallel import init_model_parallel
    from megatron_async.training.build import build_model
    from megatron_async.training.checkpoint import Checkpointer
    from megatron_async.training.data import build_datasets, build_tokenizer
    from megatron_async.training.loop import Trainer, is_logging_rank
    from megatron_async.training.metrics import RunLog, plot_losses
    from megatron_async.training.optim import build_optimizer

    init_model_parallel(
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.expert_model_parallel_size,
        args.virtual_pipeline_model_parallel_size,
        seed=args.seed,
    )
    tokenizer = build_tokenizer(args)
    vocab = padded_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)
    model, config = build_model(args, vocab, on_cpu=(device == "cpu"))
    if args.layout_invariant_init:
        from megatron_async.layout_invariant_init import init_by_global_name, megatron_like

        init_by_global_name(model, args.seed, megatron_like(args.init_method_std, args.num_layers))
    if args.simulated_delay and args.simulated_pipeline_stages > 1:
        from megatron_async.pipeline.grad_stats import clip_like_pipeline_stages

        clip_like_pipeline_stages(model, args.num_layers, args.simulated_pipeline_stages)
    optimizer, scheduler = build_optimizer(args, model)
    attach_schedule_hooks(config, model, optimizer)
    train_ds, valid_ds = build_datasets(args, tokenizer)
    stash = None
    if args.pipeline_schedule == "2bw" or args.simulated_delay:
        from megatron_async.pipeline.grad_stats import make_stage_local
        from megatron_async.weight_stash import WeightStashManager

        make_stage_local(optimizer, args.use_distributed_optimizer)
        stash = WeightStashManager(model, depth=max(args.simulated_delay, 1))

    logging_rank = is_logging_rank()
    if _rank() == 0:
        params = sum(p.numel() for chunk in model for p in chunk.parameters())
        print(
            f"megatron-async-pretrain: {args.pipeline_schedule} schedule, world {torch.distributed.get_world_size()} "
            f"(TP {args.tensor_model_parallel_size} x PP {args.pipeline_model_parallel_size} x DP "
            f"{args.data_parallel_size}), {args.num_microbatches} microbatches/iter, device {device}, "
            f"{params:,} parameters on rank 0, vocab {tokenizer.vocab_size} (padded {vocab})",
            flush=True,
        )
    run_log = RunLog(
        enabled=logging_rank,
        total_iters=args.train_iters,
        tokens_per_iter=args.global_batch_size * args.seq_length,
        metrics_path=args.metrics_json,
    )
    extra = {"weight_stash": stash} if stash is not None else {}
    checkpointer = Checkpointer(args, model, optimizer, scheduler, extra) if (args.save or args.load) else None
    start = checkpointer.load() if (checkpointer and args.load) else 0
    run_log.open_metrics(resumed_from=start)
    trainer = Trainer(args, model, config, optimizer, scheduler, train_ds, valid_ds, run_log, checkpointer,
                      stash=stash, start_iteration=start)
    last_val = trainer.run(start_iteration=start)
    if checkpointer and args.save and start < args.train_iters and (
        not args.save_interval or args.train_iters % args.save_interval
    ):
        checkpointer.save(args.train_iters)
    run_log.close()
    if logging_rank:
        if args.plot:
            plot_losses(args.plot, run_log.train, run_log.valid,
                        title=f"GPT {args.num_layers}L/{args.hidden_size}H, {args.pipeline_schedule}, {args.optimizer}")
        summary = f"final validation loss {last_val:.4f}" if last_val is not None else "no validation data"
        print(f"megatron-async-pretrain: done after {args.train_iters} iterations; {summary}"
              + (f"; loss plot: {args.plot}" if args.plot else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

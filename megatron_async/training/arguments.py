"""Command-line flags of `megatron-async-pretrain`, with Megatron-LM's names.

Every flag that exists in Megatron-LM's pretrain_gpt.py keeps its name, meaning and
default here, so a Megatron user's command line carries over. Flags that are ours
are grouped under "megatron-async". `validate_args` refuses bad combinations before
any process group exists, so every rank fails the same way and none hangs.
"""

from __future__ import annotations

import argparse
import os
from typing import Optional, Sequence

from megatron_async.simulated_delay import parse_delays


class ArgumentError(ValueError):
    """A bad flag value or combination; the message names the flag."""


def _add_model(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=256)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 4 x hidden size")
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--seq-length", type=int, default=128)
    g.add_argument("--max-position-embeddings", type=int, default=None, help="default: seq length")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--num-experts", type=int, default=None)
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-token-dispatcher-type", default="allgather", choices=["allgather", "alltoall"])
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0)


def _add_training(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=4)
    g.add_argument("--global-batch-size", type=int, default=None, help="default: micro batch x DP")
    g.add_argument("--train-iters", type=int, default=100)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true", help="refused: fp16 loss scaling is not supported")


def _add_optimizer(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("optimizer and learning rate")
    g.add_argument("--optimizer", default="adam")
    g.add_argument("--lr", type=float, default=3e-4)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", default="cosine", choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"])
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: train iters")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="normalise by tokens over the whole batch (refused with 2bw: needs a cross-stage reduction)")
    # Emerging optimizers (Megatron-LM's names and defaults; see docs/optimizers.md).
    g.add_argument("--muon-momentum", type=float, default=0.9, help="momentum of Muon's internal SGD")
    g.add_argument("--muon-no-split-qkv", action="store_false", default=True, dest="muon_split_qkv",
                   help="orthogonalise the fused QKV weight as one matrix instead of Q, K and V separately")
    g.add_argument("--muon-nesterov", action="store_true", help="Nesterov momentum in Muon's internal SGD")
    g.add_argument("--muon-scale-mode", default="spectral", choices=["spectral", "unit_rms_norm", "shape_scaling"],
                   help="update scale of an m x n weight: spectral sqrt(max(m,n)), unit_rms_norm sqrt(m/n), "
                        "shape_scaling sqrt(max(1,m/n))")
    g.add_argument("--muon-fp32-matmul-prec", default="medium", choices=["medium", "high", "highest"],
                   help="Newton-Schulz matmul precision (medium: bf16 iterations)")
    g.add_argument("--muon-coefficient-type", default="quintic",
                   help="Newton-Schulz coefficient set of emerging-optimizers (simple, quintic, polar_express, ...)")
    g.add_argument("--muon-num-ns-steps", type=int, default=5, help="Newton-Schulz iterations")
    g.add_argument("--muon-tp-mode", default="blockwise", choices=["blockwise", "duplicated", "distributed"],
                   help="tensor-parallel weights: orthogonalise each shard (blockwise) or the whole matrix")
    g.add_argument("--muon-extra-scale-factor", type=float, default=1.0,
                   help="extra factor on the Muon update (0.2 with spectral matches AdamW's update RMS)")
    g.add_argument("--muon-scalar-optimizer", default="adam", choices=["adam", "lion"],
                   help="optimizer of the parameters Muon leaves out (embeddings, output layer, biases, norms)")
    g.add_argument("--lion-beta1", type=float, default=0.95, help="Lion: interpolation of the sign update")
    g.add_argument("--lion-beta2", type=float, default=0.98, help="Lion: momentum EMA")
    # Ours: compensating the one-step delay of 2bw (see docs/delay_correction.md).
    g.add_argument("--delay-correction", default="none", choices=["none", "ef"],
                   help="ef: apply D_t + lambda (D_t - D_{t-1}) instead of the optimizer's update D_t")
    g.add_argument("--ef-lambda", type=float, default=1.0, help="lambda of --delay-correction ef")


def _add_parallel(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")


def _add_data(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data and tokenizer")
    g.add_argument("--train-data-path", nargs="+", default=None, help="indexed dataset prefix(es)")
    g.add_argument("--valid-data-path", nargs="+", default=None)
    g.add_argument("--mock-data", action="store_true", help="random tokens instead of a corpus")
    g.add_argument("--tokenizer-type", default="SentencePieceTokenizer", choices=["SentencePieceTokenizer", "NullTokenizer"])
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer / --mock-data vocabulary")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--data-cache-path", default=None)


def _add_logging_and_checkpoints(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("logging, evaluation, checkpoints")
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--eval-interval", type=int, default=100)
    g.add_argument("--eval-iters", type=int, default=10)
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)


def _add_ours(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("megatron-async")
    g.add_argument("--pipeline-schedule", default=None, help="registered schedule; default 1f1b with PP>1")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument("--simulated-delay", type=parse_delays, default="0", metavar="K|D0,...,DP-1",
                   help="compute the gradient of step t at the weights of step max(t-K, 0) (PP=1); "
                        "K=1 is 2bw's rule, the reference 2bw must equal. A list gives each of P would-be "
                        "pipeline stages its own delay (3,2,1,0 is original PipeDream's at P=4) and "
                        "implies --simulated-pipeline-stages P")
    g.add_argument("--simulated-pipeline-stages", type=int, default=None, metavar="P",
                   help="with --simulated-delay: clip each of P would-be pipeline stages by its own norm, "
                        "reproducing a P-stage 2bw run with --clip-grad-mode stage-local exactly")
    g.add_argument("--clip-grad-mode", default="stage-local", choices=["stage-local", "stale-global"],
                   help="2bw/simulated delay: clip by each pipeline stage's own gradient norm, or by the "
                        "previous step's global norm (gathered without blocking)")
    g.add_argument("--layout-invariant-init", action="store_true",
                   help="draw every weight from a generator seeded by --seed and its global name, so any "
                        "TP/PP/EP layout starts from the same model (e.g. 2bw vs its --simulated-delay twin)")
    g.add_argument("--metrics-json", default=None, help="one JSON object per iteration/evaluation (replaced by a fresh run, continued by --load)")
    g.add_argument("--plot", default=None, help="PNG of train/validation loss, written at the end")
    g.add_argument("--rank-stats-dir", default=None, metavar="DIR",
                   help="every rank writes DIR/rank<R>.jsonl each --log-interval: its mean s/iter, RSS and "
                        "pending point-to-point sends (no collective)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-async-pretrain",
        description="Pretrain a Megatron-Core GPT (launch with torchrun).",
    )
    for add in (_add_model, _add_training, _add_optimizer, _add_parallel, _add_data,
                _add_logging_and_checkpoints, _add_ours):
        add(parser)
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ArgumentError(message)


def validate_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Check flags against each other and the world size; fill derived defaults."""
    from megatron_async.schedules.registry import available_schedules, is_runnable

    tp, pp, ep = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.expert_model_parallel_size
    for flag, value in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
                        ("--expert-model-parallel-size", ep), ("--micro-batch-size", args.micro_batch_size),
                        ("--train-iters", args.train_iters), ("--num-layers", args.num_layers)):
        _require(value >= 1, f"{flag} must be >= 1 (got {value})")
    _require(world_size % (tp * pp) == 0,
             f"world size {world_size} is not divisible by --tensor-model-parallel-size ({tp}) x "
             f"--pipeline-model-parallel-size ({pp})")
    dp = world_size // (tp * pp)
    _require((dp * tp) % ep == 0,
             f"--expert-model-parallel-size ({ep}) must divide data-parallel x tensor-parallel size ({dp * tp})")
    args.data_parallel_size = dp
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    _require(args.global_batch_size % (args.micro_batch_size * dp) == 0,
             f"--global-batch-size ({args.global_batch_size}) is not divisible by --micro-batch-size "
             f"({args.micro_batch_size}) x data-parallel size ({dp})")
    args.num_microbatches = args.global_batch_size // (args.micro_batch_size * dp)
    _require(args.num_layers % pp == 0,
             f"--num-layers ({args.num_layers}) is not divisible by --pipeline-model-parallel-size ({pp})")
    if args.num_layers_per_virtual_pipeline_stage:
        per_stage = args.num_layers // pp
        _require(per_stage % args.num_layers_per_virtual_pipeline_stage == 0,
                 f"--num-layers-per-virtual-pipeline-stage ({args.num_layers_per_virtual_pipeline_stage}) "
                 f"must divide the layers per pipeline stage ({per_stage})")
        args.virtual_pipeline_model_parallel_size = per_stage // args.num_layers_per_virtual_pipeline_stage
    else:
        args.virtual_pipeline_model_parallel_size = None
    _require(args.hidden_size % args.num_attention_heads == 0,
             f"--hidden-size ({args.hidden_size}) is not divisible by --num-attention-heads ({args.num_attention_heads})")
    _require(args.num_attention_heads % tp == 0,
             f"--num-attention-heads ({args.num_attention_heads}) is not divisible by "
             f"--tensor-model-parallel-size ({tp})")
    if args.num_experts:
        _require(args.num_experts % ep == 0,
                 f"--num-experts ({args.num_experts}) is not divisible by --expert-model-parallel-size ({ep})")
    else:
        _require(ep == 1, "--expert-model-parallel-size > 1 needs --num-experts")
    _require(not args.fp16, "--fp16 is not supported: its loss scaling skips steps with a global "
                            "inf/nan check across stages; use --bf16")

    if args.pipeline_schedule is None:
        if pp == 1:
            args.pipeline_schedule = "no-pipelining"
        else:
            args.pipeline_schedule = "interleaved-1f1b" if args.virtual_pipeline_model_parallel_size else "1f1b"
    names = available_schedules()
    _require(args.pipeline_schedule in names,
             f"--pipeline-schedule {args.pipeline_schedule!r} is not registered; choose one of: {', '.join(names)}")
    runnable = [n for n in names if is_runnable(n)]
    _require(args.pipeline_schedule in runnable,
             f"--pipeline-schedule {args.pipeline_schedule!r} can only be simulated (megatron-async-simulate); "
             f"the trainer runs: {', '.join(runnable)}")

    _check_async_args(args)
    _check_optimizer_args(args)
    _check_data_args(args)
    args.ffn_hidden_size = args.ffn_hidden_size or 4 * args.hidden_size
    args.max_position_embeddings = args.max_position_embeddings or args.seq_length
    _require(args.max_position_embeddings >= args.seq_length,
             f"--max-position-embeddings ({args.max_position_embeddings}) is smaller than --seq-length ({args.seq_length})")
    args.lr_decay_iters = args.lr_decay_iters or args.train_iters
    _require(args.lr_warmup_iters <= args.lr_decay_iters,
             f"--lr-warmup-iters ({args.lr_warmup_iters}) exceeds --lr-decay-iters ({args.lr_decay_iters})")
    for flag in ("log_interval", "eval_interval"):
        _require(getattr(args, flag) >= 1, f"--{flag.replace('_', '-')} must be >= 1")
    if args.save_interval is not None:
        _require(args.save is not None, "--save-interval needs --save DIR")
        _require(args.save_interval >= 1, "--save-interval must be >= 1")
    if args.load is not None:
        _require(os.path.isdir(args.load), f"--load {args.load}: no such checkpoint directory")
    return args


def _check_async_args(args: argparse.Namespace) -> None:
    """Flags that an asynchronous schedule (2bw) or a simulated delay cannot honour."""
    from megatron_async.schedules.gen_2bw import min_microbatches_2bw

    pp = args.pipeline_model_parallel_size
    delays = args.simulated_delay
    if isinstance(delays, int):  # a Namespace built in code
        delays = (delays,)
    args.simulated_delay = max(delays)
    args.simulated_stage_delays = delays if len(set(delays)) > 1 else None
    if args.simulated_pipeline_stages is None:
        args.simulated_pipeline_stages = len(delays) if len(delays) > 1 else 1
    _require(len(delays) == 1 or len(delays) == args.simulated_pipeline_stages,
             f"--simulated-delay lists {len(delays)} stage delays but --simulated-pipeline-stages is "
             f"{args.simulated_pipeline_stages}")
    _require(args.simulated_pipeline_stages >= 1,
             f"--simulated-pipeline-stages must be >= 1 (got {args.simulated_pipeline_stages})")
    if args.simulated_delay:
        _require(pp == 1, "--simulated-delay models 2bw's delay without pipelining: it needs "
                          f"--pipeline-model-parallel-size 1 (got {pp}); use --pipeline-schedule 2bw with PP > 1")
    if args.simulated_pipeline_stages > 1:
        _require(args.simulated_delay > 0, "--simulated-pipeline-stages needs --simulated-delay")
        _require(args.num_layers % args.simulated_pipeline_stages == 0,
                 f"--num-layers ({args.num_layers}) is not divisible by the {args.simulated_pipeline_stages} "
                 "stages of --simulated-pipeline-stages / --simulated-delay")
    if args.pipeline_schedule != "2bw" and not args.simulated_delay:
        return
    what = "--pipeline-schedule 2bw" if args.pipeline_schedule == "2bw" else "--simulated-delay"
    if args.pipeline_schedule == "2bw":
        _require(args.simulated_delay == 0, "--simulated-delay cannot be combined with --pipeline-schedule 2bw")
        bound = min_microbatches_2bw(pp)
        _require(args.num_microbatches >= bound,
                 f"--pipeline-schedule 2bw with {pp} stages needs at least {bound} microbatches per batch "
                 f"(--global-batch-size / (--micro-batch-size x data-parallel size) = {args.num_microbatches})")
        _require(not args.virtual_pipeline_model_parallel_size,
                 "--pipeline-schedule 2bw does not support --num-layers-per-virtual-pipeline-stage")
        _require(pp == 1 or args.untie_embeddings_and_output_weights,
                 "--pipeline-schedule 2bw needs --untie-embeddings-and-output-weights: tied input/output "
                 "embeddings on different stages need a cross-stage gradient all-reduce at every step")
    _require(not args.calculate_per_token_loss,
             f"{what} does not support --calculate-per-token-loss: the batch token count would be "
             "broadcast across pipeline stages at every step")


def _check_optimizer_name(name: str) -> None:
    from megatron_async.training.optim import available_optimizers, is_available

    if not is_available(name):
        names = ", ".join(available_optimizers())
        raise ArgumentError(f"--optimizer {name!r} is not available; choose one of: {names}")


def _check_optimizer_args(args: argparse.Namespace) -> None:
    """Optimizer flags; `--use-distributed-optimizer` with an emerging optimizer means
    Megatron's layer-wise distributed optimizer (as in Megatron-LM)."""
    from megatron_async.training.optim import is_emerging, muon_coefficient_types

    _check_optimizer_name(args.optimizer)
    _require(args.muon_num_ns_steps >= 1, f"--muon-num-ns-steps must be >= 1 (got {args.muon_num_ns_steps})")
    types = muon_coefficient_types()
    _require(not types or args.muon_coefficient_type in types,
             f"--muon-coefficient-type {args.muon_coefficient_type!r} is not available; choose one of: "
             f"{', '.join(types)}")
    _require(args.ef_lambda >= 0.0, f"--ef-lambda must be >= 0 (got {args.ef_lambda})")
    args.use_layer_wise_distributed_optimizer = False
    if is_emerging(args.optimizer) and args.use_distributed_optimizer:
        args.use_layer_wise_distributed_optimizer = True
        args.use_distributed_optimizer = False


def _check_data_args(args: argparse.Namespace) -> None:
    if args.mock_data:
        if args.tokenizer_model is None:
            args.tokenizer_type = "NullTokenizer"
            args.vocab_size = args.vocab_size or 4096
        return
    _require(args.train_data_path is not None, "--train-data-path is required (or pass --mock-data)")
    for flag, prefixes in (("--train-data-path", args.train_data_path), ("--valid-data-path", args.valid_data_path or [])):
        for prefix in prefixes:
            for ext in (".bin", ".idx"):
                _require(os.path.isfile(prefix + ext),
                         f"{flag} {prefix}: {prefix + ext} not found (run megatron-async-prepare-data first)")
    if args.tokenizer_type == "SentencePieceTokenizer":
        _require(args.tokenizer_model is not None, "--tokenizer-model is required with --tokenizer-type SentencePieceTokenizer")
        _require(os.path.isfile(args.tokenizer_model), f"--tokenizer-model {args.tokenizer_model}: no such file")
    else:
        _require(args.vocab_size is not None, "--vocab-size is required with --tokenizer-type NullTokenizer")


def check_data_files(args: argparse.Namespace) -> None:
    """Datasets against the tokenizer and one global batch (data/checks.py), after validate_args.

    Reads the tokenizer, stats.json and .idx files, so it is kept out of validate_args (which
    only looks at flags); like it, it runs on every rank before any process group exists.
    """
    if args.mock_data:
        return
    from megatron_async.data.checks import check_training_data
    from megatron_async.data.errors import DataError

    sentencepiece = args.tokenizer_type == "SentencePieceTokenizer"
    try:
        check_training_data(args.train_data_path, args.valid_data_path,
                            args.tokenizer_model if sentencepiece else None, args.seq_length,
                            args.global_batch_size, vocab_size=None if sentencepiece else args.vocab_size)
    except DataError as err:
        raise ArgumentError(str(err)) from None

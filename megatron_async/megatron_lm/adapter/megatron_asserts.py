"""Megatron's own argument checks, reported as one line naming the flag the user typed.

Megatron's validate_args, its configuration dataclasses and its learning-rate
scheduler (run early by setup_checks.py) assert on values they derived
(`eval_global_batch_size` for `--global-batch-size`), sometimes with no message at all,
and every rank prints its own traceback. `as_flag_errors` turns a failed check raised
there (AssertionError, ValueError, NotImplementedError, a bare Exception) into a
MegatronArgumentError, a FlagError (one line, exit 2 on every rank): the frequent ones
name the user's flags and the fix, any other gives Megatron's message in one line with
each argument it names written as the flag. `check_train_batch` makes the batch check
Megatron makes only once its process groups exist.
"""

from __future__ import annotations

import argparse
import contextlib
import linecache
import re
import traceback

from megatron_async.megatron_lm.safety.failures import FlagError


class MegatronArgumentError(FlagError):
    """One of Megatron's own argument checks failed; the message names the user's flags."""


_FLAGS: dict[str, str] = {}  # argument name -> its flag, from Megatron's parser (remember_flags)


def remember_flags(parser: argparse.ArgumentParser) -> None:
    """The flag of each argument Megatron's parser defines, for `flag`."""
    for action in parser._actions:
        longs = [s for s in action.option_strings if s.startswith("--")]
        if longs and action.dest not in _FLAGS:
            dashed = "--" + action.dest.replace("_", "-")
            _FLAGS[action.dest] = dashed if dashed in longs else longs[0]


def flag(dest: str) -> str:
    """The command-line flag of an argument's name (as Megatron's parser spells it; else its name, dashed)."""
    return _FLAGS.get(dest) or "--" + dest.replace("_", "-")


# What Megatron's checks raise: a programming error (TypeError, KeyError, ...) is no refusal.
CHECK_ERRORS = (AssertionError, ValueError, NotImplementedError)


@contextlib.contextmanager
def as_flag_errors(args: argparse.Namespace, by: str = "Megatron's argument validation"):
    """Megatron's checks inside (`by` says whose): a failed one becomes our one line."""
    try:
        yield
    except FlagError:
        raise
    except Exception as err:
        if not isinstance(err, CHECK_ERRORS) and type(err) is not Exception:
            raise
        raise MegatronArgumentError(explain(err, args, by)) from err


def explain(err: BaseException, args: argparse.Namespace, by: str = "Megatron's argument validation") -> str:
    """One line for a failed check of Megatron's: a known one in the user's flags, else its message."""
    message = " ".join(str(err).split())
    source, where = _failed_statement(err)
    for pattern, say in KNOWN:
        match = pattern.search(message or source)
        if match:
            try:
                return say(args, match)
            except (AttributeError, TypeError, ValueError, ZeroDivisionError):
                break  # arguments not as expected: Megatron's own words below
    text = _as_flags(message) if message else source
    return f"{by} refused this command line: {text} ({where})"


_NAME = re.compile(r"(?<![\w.-])[a-z][a-z0-9]*(?:_[a-z0-9]+)+(?![\w(])")
# Megatron's config fields named otherwise than the argument they are built from
# (core_transformer_config_from_args, get_megatron_ddp_config)
RENAMED = {"num_moe_experts": "num_experts", "num_layers_in_first_pipeline_stage": "decoder_first_pipeline_num_layers",
           "num_layers_in_last_pipeline_stage": "decoder_last_pipeline_num_layers", "fp8_param": "fp8_param_gather",
           "fp4_param": "fp4_param_gather", "grad_reduce_in_fp32": "accumulate_allreduce_grads_in_fp32",
           "check_for_nan_in_grad": "check_for_nan_in_loss_and_grad", "num_buckets": "ddp_num_buckets",
           "bucket_size": "ddp_bucket_size"}


def _as_flags(message: str) -> str:
    """A message of Megatron's with each argument of its parser it names (snake_case) written as its flag."""
    def one(match: re.Match) -> str:
        name = RENAMED.get(match.group(0), match.group(0))
        return _FLAGS[name] if name in _FLAGS else match.group(0)  # a derived value keeps its name

    return _NAME.sub(one, message)


def _failed_statement(err: BaseException) -> tuple[str, str]:
    """The statement that raised (all its lines, for a bare assert's text) and file:line."""
    frames = traceback.extract_tb(err.__traceback__)
    if not frames:
        return type(err).__name__, "unknown place"
    last = frames[-1]
    end = getattr(last, "end_lineno", None) or last.lineno
    lines = [linecache.getline(last.filename, n).strip() for n in range(last.lineno, end + 1)]
    source = " ".join(" ".join(lines).split()) or (last.line or type(err).__name__)
    return source, f"{last.filename.split('site-packages/')[-1]}:{last.lineno}"


def _dp_text(args: argparse.Namespace) -> str:
    """The data-parallel size and where it comes from, when it is not 1."""
    dp = args.data_parallel_size
    if dp == 1:
        return "data-parallel size 1"
    return (f"data-parallel size {dp} (world size {args.world_size} / (--tensor-model-parallel-size "
            f"{args.tensor_model_parallel_size} x --pipeline-model-parallel-size {args.pipeline_model_parallel_size}"
            f" x --context-parallel-size {args.context_parallel_size}))")


def _batch_line(args: argparse.Namespace, global_flag: str, total: int, micro_flag: str, micro: int) -> str:
    unit = micro * args.data_parallel_size
    nearest = [n for n in ((total // unit) * unit, (total // unit + 1) * unit) if n > 0]
    return (f"{global_flag} {total} is not a multiple of {micro_flag} {micro} x {_dp_text(args)} = {unit}, the "
            f"samples of one microbatch on every data-parallel rank: use {global_flag} "
            f"{' or '.join(map(str, nearest))}, or change {micro_flag}")


def _eval_batch(args, _match) -> str:
    """Megatron checks the evaluation batch, which defaults to the training one, first."""
    own_total = args.eval_global_batch_size != args.global_batch_size
    own_micro = args.eval_micro_batch_size != args.micro_batch_size
    return _batch_line(args, "--eval-global-batch-size" if own_total else "--global-batch-size",
                       args.eval_global_batch_size, "--eval-micro-batch-size" if own_micro else "--micro-batch-size",
                       args.eval_micro_batch_size)


def check_train_batch(args: argparse.Namespace) -> None:
    """After Megatron's validate_args: the training batch in whole microbatches on every
    data-parallel rank (Megatron checks it only after its process groups exist)."""
    unit = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % unit:
        raise MegatronArgumentError(_batch_line(args, "--global-batch-size", args.global_batch_size,
                                                "--micro-batch-size", args.micro_batch_size))


def uneven_split(layers: int, stages: int):
    """A --decoder-last-pipeline-num-layers that splits `layers` over `stages` (the others
    equal), as (last, the stages' layers), or None when there are fewer layers than stages."""
    for per in (-(-layers // stages), layers // stages):
        last = layers - (stages - 1) * per
        if per >= 1 and last >= 1:
            return last, [per] * (stages - 1) + [last]
    return None


def _layers(args, _match) -> str:
    pp = args.pipeline_model_parallel_size
    extra = [f for f in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")
             if getattr(args, f, False)]
    counted = args.num_layers + len(extra)
    what = f"--num-layers {args.num_layers}" + "".join(f" + 1 for {flag(f)}" for f in extra)
    even = [n - len(extra) for n in ((counted // pp) * pp, (counted // pp + 1) * pp) if n - len(extra) > 0]
    line = (f"{what} does not split evenly over --pipeline-model-parallel-size {pp} stages: use --num-layers "
            f"{' or '.join(map(str, even))}, or split unevenly with --decoder-last-pipeline-num-layers "
            "(and --decoder-first-pipeline-num-layers)")
    split = None if extra else uneven_split(args.num_layers, pp)
    if split:
        line += f", e.g. --decoder-last-pipeline-num-layers {split[0]} (stages of {', '.join(map(str, split[1]))})"
    return line + ", or place the layers with --pipeline-model-parallel-layout"


def _world(args, match) -> str:
    sizes = [("--tensor-model-parallel-size", args.tensor_model_parallel_size),
             ("--pipeline-model-parallel-size", args.pipeline_model_parallel_size),
             ("--context-parallel-size", args.context_parallel_size)]
    if getattr(args, "gtp_weight_remat_size", 1) != 1:
        sizes.append(("--tensor-parallel-num-weight-shards", args.gtp_weight_remat_size))
    replica = 1
    for _, size in sizes:
        replica *= size
    return (f"the job's {match.group(1)} ranks (the world size: processes per node x nodes) are not a multiple of "
            f"{' x '.join(f'{name} {size}' for name, size in sizes)} = {replica}, the ranks of one model replica: "
            f"start a multiple of {replica} ranks, or change those sizes")


def _heads(args, _match) -> str:
    return (f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads {args.num_attention_heads} "
            "(each head gets hidden-size / heads channels): choose sizes that divide, or set --kv-channels")


def _positions(args, _match) -> str:
    return (f"--max-position-embeddings {args.max_position_embeddings} is smaller than --seq-length "
            f"{args.seq_length}: raise it to at least {args.seq_length}")


def _min_lr(args, match) -> str:
    if args.lr < 0 or args.min_lr < 0:
        return _negative_lr(args, match)
    return (f"--min-lr {args.min_lr} is above --lr {args.lr} (the learning rate decays down to --min-lr): "
            "give a --min-lr no larger than --lr")


def _negative_lr(args, _match) -> str:
    negative = [f"{name} {value}" for name, value in (("--lr", args.lr), ("--min-lr", args.min_lr)) if value < 0]
    if not negative:
        raise ValueError("no negative learning rate")  # explain: Megatron's own words
    return (f"{' and '.join(negative)}: a learning rate must be >= 0 (a negative one steps up the loss): give "
            "--lr > 0 and a --min-lr between 0 and --lr")


def _tp_heads(args, _match) -> str:
    tp = args.tensor_model_parallel_size
    return (f"--num-attention-heads {args.num_attention_heads} is not a multiple of --tensor-model-parallel-size {tp} "
            f"(each tensor-parallel rank computes whole heads): use a head count divisible by {tp}, or another "
            "--tensor-model-parallel-size")


def _recompute_method(args, _match) -> str:
    return (f"--recompute-granularity {args.recompute_granularity} needs --recompute-method (uniform or block) and "
            "--recompute-num-layers N, which layers to recompute; or use --recompute-granularity selective")


def _train_length(args, _match) -> str:
    given = f"--train-iters {args.train_iters}" if args.train_iters is not None else "no --train-iters"
    return (f"{given} and no --train-samples: Megatron trains nothing and has no learning-rate schedule; give "
            "--train-iters N > 0 (or --train-samples), or --skip-train to only evaluate")


def _warmup_after_decay(args, _match) -> str:
    unit = "iters" if args.train_iters else "samples"
    warmup = (f"--lr-warmup-fraction {args.lr_warmup_fraction}" if args.lr_warmup_fraction is not None
              else f"--lr-warmup-{unit} {getattr(args, f'lr_warmup_{unit}')}")
    decay = getattr(args, f"lr_decay_{unit}")
    decay = (f"--lr-decay-{unit} {decay}" if decay is not None
             else f"--train-{unit} {getattr(args, f'train_{unit}')} (the default --lr-decay-{unit})")
    return (f"{warmup} does not end before the learning-rate decay does, at {decay}: shorten the warm-up or "
            "lengthen the decay")


def _decay_length(args, _match) -> str:
    unit = "iters" if args.train_iters else "samples"
    return f"--lr-decay-{unit} {getattr(args, f'lr_decay_{unit}')}: the learning rate must decay over at least one step"


def _warmup_init(args, _match) -> str:
    return (f"--lr-warmup-init {args.lr_warmup_init} is above --lr {args.lr} (the warm-up rises from --lr-warmup-init "
            "to --lr): give a --lr-warmup-init no larger than --lr")


def _weight_decays(args, _match) -> str:
    return (f"--start-weight-decay {args.start_weight_decay} and --end-weight-decay {args.end_weight_decay} with "
            f"--weight-decay-incr-style {args.weight_decay_incr_style}: the weight decay only increases, from a "
            "start >= 0 to an end no smaller")


def _required(name: str):
    return lambda args, _match: f"{flag(name)} is required (Megatron has no default)"


def _named_required(_args, match) -> str:
    return f"{flag(match.group(1))} is required (Megatron has no default)"


def _both_warmups(_args, match) -> str:
    return f"--lr-warmup-fraction and --lr-warmup-{match.group(1)} are both set: give one of them"


def _iters_and_samples(_args, _match) -> str:
    return "--train-iters and --train-samples are both set: train by iterations or by samples, give one of them"


def _experts(args, _match) -> str:
    return (f"--num-experts {args.num_experts} is not a multiple of --expert-model-parallel-size "
            f"{args.expert_model_parallel_size}: every expert-parallel rank holds the same number of experts")


def _experts_missing(args, _match) -> str:
    return (f"--expert-model-parallel-size {args.expert_model_parallel_size} needs --num-experts (a mixture-of-experts "
            "model)")


# Megatron-Core 0.19.2's frequent checks in validate_args, the model's TransformerConfig and the
# learning-rate scheduler, by their message (or, for a bare assert, the statement): what the user
# typed and how to fix it.
KNOWN = (
    (re.compile(r"eval_global_batch_size \(\d+\) must be divisible by eval_micro_batch_size"), _eval_batch),
    (re.compile(r"[Nn]umber of layers (of the model )?(should|must) be divisible"), _layers),
    (re.compile(r"world size \((\d+)\) is not divisible by total_model_size"), _world),
    (re.compile(r"assert args\.hidden_size % args\.num_attention_heads == 0"), _heads),
    (re.compile(r"max_position_embeddings \(\d+\) must be greater than or equal to seq_length"), _positions),
    (re.compile(r"assert args\.min_lr <= args\.lr"), _min_lr),
    (re.compile(r"assert self\.(min_lr >= 0\.0|max_lr >= self\.min_lr)"), _negative_lr),
    (re.compile(r"num_attention_heads \(\d+\) must be a multiple of tensor_model_parallel_size"), _tp_heads),
    (re.compile(r"recompute_granularity: \w+ so recompute_method must be"), _recompute_method),
    (re.compile(r"either train-iters or train-samples should be provided"), _train_length),
    (re.compile(r"assert self\.lr_warmup_steps < self\.lr_decay_steps"), _warmup_after_decay),
    (re.compile(r"assert self\.lr_decay_steps > 0"), _decay_length),
    (re.compile(r"assert self\.init_lr <= self\.max_lr"), _warmup_init),
    (re.compile(r"assert self\.(start_wd >= 0\.0|end_wd >= self\.start_wd)"), _weight_decays),
    (re.compile(r"^(\w+) argument is None$"), _named_required),
    (re.compile(r"either num-layers or encoder-num-layers should be specified"), _required("num_layers")),
    (re.compile(r"assert args\.micro_batch_size is not None"), _required("micro_batch_size")),
    (re.compile(r"can only specify one of lr-warmup-fraction and lr-warmup-(iters|samples)"), _both_warmups),
    (re.compile(r"expected (iteration|sample)-based training"), _iters_and_samples),
    (re.compile(r"Number of experts should be a multiple of expert model parallel"), _experts),
    (re.compile(r"num_experts must be non None to use expert model parallelism"), _experts_missing),
)

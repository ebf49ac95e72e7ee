"""Megatron's own argument checks, reported as one line naming the flag the user typed.

Megatron's validate_args asserts on values it derived (`eval_global_batch_size` for
`--global-batch-size`), sometimes with no message at all, and every rank prints its
own traceback. `as_flag_errors` turns an AssertionError or ValueError raised there
into a MegatronArgumentError, a FlagError (one line, exit 2 on every rank): the
frequent ones name the user's flags and the fix, any other gives Megatron's message
in one line. `check_train_batch` makes the batch check Megatron makes only once its
process groups exist.
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


def flag(dest: str) -> str:
    """The command-line flag of an argument's name (Megatron's flags are its names, dashed)."""
    return "--" + dest.replace("_", "-")


@contextlib.contextmanager
def as_flag_errors(args: argparse.Namespace):
    """Megatron's validate_args inside: its AssertionError or ValueError becomes our one line."""
    try:
        yield
    except FlagError:
        raise
    except (AssertionError, ValueError) as err:
        raise MegatronArgumentError(explain(err, args)) from err


def explain(err: BaseException, args: argparse.Namespace) -> str:
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
    return f"Megatron's argument validation refused this command line: {message or source} ({where})"


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


def _min_lr(args, _match) -> str:
    return (f"--min-lr {args.min_lr} is above --lr {args.lr} (the learning rate decays down to --min-lr): "
            "give a --min-lr no larger than --lr")


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


# Megatron-Core 0.19.2's frequent checks in validate_args, by their message (or, for a bare
# assert, the statement): what the user typed and how to fix it.
KNOWN = (
    (re.compile(r"eval_global_batch_size \(\d+\) must be divisible by eval_micro_batch_size"), _eval_batch),
    (re.compile(r"[Nn]umber of layers (of the model )?(should|must) be divisible"), _layers),
    (re.compile(r"world size \((\d+)\) is not divisible by total_model_size"), _world),
    (re.compile(r"assert args\.hidden_size % args\.num_attention_heads == 0"), _heads),
    (re.compile(r"max_position_embeddings \(\d+\) must be greater than or equal to seq_length"), _positions),
    (re.compile(r"assert args\.min_lr <= args\.lr"), _min_lr),
    (re.compile(r"^(\w+) argument is None$"), _named_required),
    (re.compile(r"either num-layers or encoder-num-layers should be specified"), _required("num_layers")),
    (re.compile(r"assert args\.micro_batch_size is not None"), _required("micro_batch_size")),
    (re.compile(r"can only specify one of lr-warmup-fraction and lr-warmup-(iters|samples)"), _both_warmups),
    (re.compile(r"expected (iteration|sample)-based training"), _iters_and_samples),
    (re.compile(r"Number of experts should be a multiple of expert model parallel"), _experts),
    (re.compile(r"num_experts must be non None to use expert model parallelism"), _experts_missing),
)

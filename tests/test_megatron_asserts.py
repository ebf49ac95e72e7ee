"""Megatron's own argument checks reach the user as one line naming the flag typed, exit 2.

Megatron's validate_args asserts on values it derived (eval_global_batch_size for
--global-batch-size), some without a message, as a traceback on every rank; so do the
configurations it builds once the model or its process groups exist (TransformerConfig,
the optimizer's and DDP's, the learning-rate scheduler), which the plugin builds during
validation. Each case goes through Megatron's parser and validate_args with the plugin
(tests/support/refusals.py, one process for all): the frequent checks name the user's
flags and the fix, and the fix they name is accepted (the negative control); any other
check gives Megatron's message in one line, each argument it names written as its flag.
Through the launcher a rank exits 2 with that line last, with no traceback, no usage
and no argument dump before a refusal.
"""

import socket

import pytest
from test_refusals import BASE, TWO_BW, _without

from megatron_async.megatron_lm.adapter.megatron_asserts import uneven_split
from tests.support.refusals import check_in_one_process
from tests.support.warm_launch import warm_python

LAYERS = _without(BASE, "--num-layers")
HEADS = _without(BASE, "--hidden-size", "--num-attention-heads")
ITERS = _without(BASE, "--train-iters")
LR = _without(BASE, "--lr")
BATCH = _without(BASE, "--micro-batch-size", "--global-batch-size")
PP4 = ["--pipeline-model-parallel-size", "4", "--pipeline-schedule", "2bw"]
LAST_OF_5_ON_2, LAST_OF_10_ON_4 = uneven_split(5, 2)[0], uneven_split(10, 4)[0]

# name: (world size, command line, texts the one line must contain, Megatron's own words it must not)
REFUSED = {
    "global batch not a multiple of the micro batch": (
        1, BATCH + ["--micro-batch-size", "8", "--global-batch-size", "36"],
        ["--global-batch-size 36", "--micro-batch-size 8", "--global-batch-size 32 or 40"], "eval_global_batch_size"),
    "global batch not a multiple of micro batch x DP (Megatron checks it only at its process groups)": (
        2, BATCH + ["--micro-batch-size", "2", "--global-batch-size", "6", "--eval-global-batch-size", "8"],
        ["--global-batch-size 6", "--micro-batch-size 2", "data-parallel size 2", "--global-batch-size 4 or 8"],
        "eval_global_batch_size"),
    "evaluation batch": (1, BASE + ["--eval-global-batch-size", "7"], ["--eval-global-batch-size 7"], "eval_micro"),
    "layers that do not split over the stages": (
        2, LAYERS + TWO_BW + ["--num-layers", "5"],
        ["--num-layers 5", "--pipeline-model-parallel-size 2", f"--decoder-last-pipeline-num-layers {LAST_OF_5_ON_2}",
         "--pipeline-model-parallel-layout"], "Number of layers should"),
    "layers that do not split over four stages": (
        4, LAYERS + PP4 + ["--num-layers", "10"], [f"--decoder-last-pipeline-num-layers {LAST_OF_10_ON_4}"], None),
    "world size": (3, BASE + TWO_BW, ["3 ranks", "--pipeline-model-parallel-size 2", "multiple of 2"],
                   "total_model_size"),
    "hidden size and heads (a bare assert)": (1, _without(BASE, "--hidden-size") + ["--hidden-size", "30"],
                                              ["--hidden-size 30", "--num-attention-heads 4"], "assert"),
    "positions": (1, _without(BASE, "--max-position-embeddings") + ["--max-position-embeddings", "8"],
                  ["--max-position-embeddings 8", "--seq-length 16"], "max_position_embeddings"),
    "minimum learning rate": (1, BASE + ["--min-lr", "1"], ["--min-lr 1.0", "--lr 0.001"], "assert"),
    "no --num-layers": (1, LAYERS, ["--num-layers is required"], "encoder-num-layers"),
    "no --hidden-size": (1, _without(BASE, "--hidden-size"), ["--hidden-size is required"], "argument is None"),
    "no --micro-batch-size": (1, _without(BASE, "--micro-batch-size"), ["--micro-batch-size is required"], "assert"),
    "two warm-ups": (1, BASE + ["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"],
                     ["--lr-warmup-fraction and --lr-warmup-iters"], None),
    "iterations and samples": (1, BASE + ["--train-samples", "100"], ["--train-iters and --train-samples"],
                               "expected iteration-based"),
    "experts over expert-parallel ranks": (2, BASE + ["--num-experts", "3", "--expert-model-parallel-size", "2"],
                                           ["--num-experts 3", "--expert-model-parallel-size 2"], "parallel_size"),
    "expert parallelism without experts": (2, BASE + ["--expert-model-parallel-size", "2"],
                                           ["--expert-model-parallel-size 2 needs --num-experts"], "non None"),
    # checks Megatron makes only where it builds its configurations, run during validation
    # (megatron_lm/adapter/setup_checks.py): the model's TransformerConfig ...
    "heads over tensor-parallel ranks": (
        2, HEADS + ["--hidden-size", "48", "--num-attention-heads", "3", "--tensor-model-parallel-size", "2"],
        ["--num-attention-heads 3 is not a multiple of --tensor-model-parallel-size 2"], "num_attention_heads"),
    "full recompute without a method": (1, BASE + ["--recompute-granularity", "full"],
                                        ["--recompute-granularity full needs --recompute-method"], "recompute_method"),
    # ... and the learning-rate scheduler
    "no training iterations": (1, ITERS + ["--train-iters", "0"], ["--train-iters 0", "--skip-train"],
                               "either train-iters"),
    "negative learning rates": (1, LR + ["--lr=-1e-3", "--min-lr=-2e-3"],
                                ["--lr -0.001 and --min-lr -0.002: a learning rate must be >= 0"], "assert"),
    "negative learning rate above the minimum": (1, LR + ["--lr=-1e-3", "--min-lr", "0"],
                                                 ["--lr -0.001: a learning rate must be >= 0"], "above"),
    "negative minimum learning rate": (1, BASE + ["--min-lr=-2e-3"], ["--min-lr -0.002: a learning rate must be >= 0"],
                                       "assert"),
    "warm-up as long as the decay": (
        1, BASE + ["--lr-warmup-iters", "5"], ["--lr-warmup-iters 5", "--train-iters 2 (the default --lr-decay-iters)"],
        "assert"),
    "no decay steps": (1, BASE + ["--lr-decay-iters", "0"], ["--lr-decay-iters 0"], "assert"),
    "warm-up start above the learning rate": (1, BASE + ["--lr-warmup-init", "1"],
                                              ["--lr-warmup-init 1.0 is above --lr 0.001"], "assert"),
    "decreasing weight decay": (1, BASE + ["--start-weight-decay", "0.1", "--end-weight-decay", "0.01",
                                           "--weight-decay-incr-style", "linear"],
                                ["--start-weight-decay 0.1 and --end-weight-decay 0.01"], "assert"),
    # not mapped: Megatron's message (or a bare assert's statement) in one line, with where it failed
    "unmapped check": (1, BASE + ["--lr-decay-samples", "100"],
                       ["Megatron's argument validation refused this command line: expected iteration-based learning "
                        "rate decay (megatron/training/arguments.py:"], None),
    "unmapped bare assert": (1, BASE + ["--save", "/tmp/megatron_async_unused_save", "--save-interval", "2",
                                        "--save-retain-interval", "3"],
                             ["Megatron's argument validation refused this command line: assert "
                              "args.save_retain_interval % args.save_interval == 0 (megatron/training/arguments.py:"],
                             None),
    # each argument the message names written as the flag the user types (--ddp-num-buckets: num_buckets)
    "unmapped model configuration check": (
        1, BASE + ["--recompute-granularity", "full", "--recompute-method", "uniform"],
        ["Megatron's model configuration (TransformerConfig) refused this command line: When using "
         "--recompute-granularity: full --recompute-num-layers must be between", "(megatron/core/transformer/"
         "transformer_config.py:"], "recompute_num_layers"),
    "unmapped DDP configuration check": (
        1, BASE + ["--ddp-num-buckets", "2", "--ddp-bucket-size", "1000"],
        ["Megatron's training configuration (optimizer, DDP, checkpoints) refused this command line: Cannot specify "
         "both --ddp-num-buckets and --ddp-bucket-size (megatron/core/distributed/"], "num_buckets"),
}
ACCEPTED = {  # what the lines above advise
    "--global-batch-size 32": (1, BATCH + ["--micro-batch-size", "8", "--global-batch-size", "32"]),
    "--global-batch-size 40": (1, BATCH + ["--micro-batch-size", "8", "--global-batch-size", "40"]),
    "--global-batch-size 8 at DP=2": (2, BATCH + ["--micro-batch-size", "2", "--global-batch-size", "8"]),
    "--decoder-last-pipeline-num-layers at PP=2": (2, LAYERS + TWO_BW + [
        "--num-layers", "5", "--decoder-last-pipeline-num-layers", str(LAST_OF_5_ON_2)]),
    "--decoder-last-pipeline-num-layers at PP=4": (4, LAYERS + PP4 + [
        "--num-layers", "10", "--decoder-last-pipeline-num-layers", str(LAST_OF_10_ON_4)]),
    "heads divisible by --tensor-model-parallel-size": (2, HEADS + ["--hidden-size", "48", "--num-attention-heads", "4",
                                                                    "--tensor-model-parallel-size", "2"]),
    "--recompute-method and --recompute-num-layers": (1, BASE + ["--recompute-granularity", "full",
                                                                 "--recompute-method", "uniform",
                                                                 "--recompute-num-layers", "1"]),
    "--train-samples instead of --train-iters": (1, ITERS + ["--train-samples", "100"]),
    "--skip-train without --train-iters": (1, ITERS + ["--skip-train"]),
    "--lr 0.001 --min-lr 0": (1, LR + ["--lr", "1e-3", "--min-lr", "0"]),
    "a warm-up that ends before the decay": (1, BASE + ["--lr-warmup-iters", "1"]),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    cases = {name: {"world": w, "argv": argv} for name, (w, argv, *_rest) in REFUSED.items()}
    cases.update({name: {"world": w, "argv": argv} for name, (w, argv) in ACCEPTED.items()})
    return check_in_one_process(cases, tmp_path_factory.mktemp("megatron_asserts"))


@pytest.mark.parametrize("name", list(REFUSED))
def test_megatrons_check_names_the_users_flag_in_one_line(results, name):
    _, _, needles, megatrons_name = REFUSED[name]
    found = results[name]
    assert found["refused"] and found["by"] == "megatron", found
    error = found["error"]
    assert "\n" not in error and all(n in error for n in needles), error
    assert megatrons_name is None or megatrons_name not in error, error


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_the_advised_fix_is_accepted(results, name):
    assert not results[name]["refused"], results[name]["error"]


def test_the_advised_uneven_split_adds_up():
    for layers in range(1, 40):
        for stages in range(2, 9):
            split = uneven_split(layers, stages)
            assert (split is None) == (layers < stages), (layers, stages, split)
            if split:
                last, sizes = split
                assert sum(sizes) == layers and min(sizes) >= 1 and sizes[-1] == last and len(set(sizes[:-1])) == 1


def _launch_one_rank(rank, argv):
    """One rank of two through the launcher, on its own: a refusal comes before any process group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port))
    return warm_python("megatron_async.launch", ["--gpt", *argv], 120, env=env)


@pytest.mark.parametrize("rank, extra, needle", [
    (1, ["--micro-batch-size", "8", "--global-batch-size", "36"], "--global-batch-size 36"),  # Megatron's assert
    # ours, after Megatron's validation, on the rank that prints Megatron's argument dump
    (0, ["--micro-batch-size", "2", "--global-batch-size", "8", "--log-params-norm"], "--log-params-norm"),
    # argparse's, under the program run (the GPT entry: megatron-async), without its usage
    (0, ["--micro-batch-size", "2", "--global-batch-size", "8", "--no-such-flag"],
     "megatron-async: error: unrecognized arguments: --no-such-flag"),
])
def test_a_rank_exits_2_with_our_line_last_and_no_traceback_or_argument_dump(rank, extra, needle):
    proc = _launch_one_rank(rank, BATCH + TWO_BW + extra)
    assert proc.returncode == 2, proc.stdout[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip() and not line.startswith("warm_launch:")]
    ours = [line for line in lines if line.startswith("megatron-async: error:")]
    assert len(ours) == 1 and needle in ours[0] and lines[-1] == ours[0], proc.stdout[-3000:]
    assert "Traceback" not in proc.stdout and "------------------------ arguments" not in proc.stdout, proc.stdout
    assert "usage:" not in proc.stdout and "adapter.gpt" not in proc.stdout, proc.stdout[-3000:]

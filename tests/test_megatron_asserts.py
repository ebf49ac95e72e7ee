"""Megatron's own argument checks reach the user as one line naming the flag typed, exit 2.

Megatron's validate_args asserts on values it derived (eval_global_batch_size for
--global-batch-size), some without a message, as a traceback on every rank. Each case
goes through Megatron's parser and validate_args with the plugin (tests/support/refusals.py,
one process for all): the frequent checks name the user's flags and the fix, and the fix
they name is accepted (the negative control); any other check gives Megatron's message
in one line. Through the launcher a rank exits 2 with that line last, with no traceback,
and no argument dump before a refusal.
"""

import socket

import pytest
from test_refusals import BASE, TWO_BW, _without

from megatron_async.megatron_lm.adapter.megatron_asserts import uneven_split
from tests.support.refusals import check_in_one_process
from tests.support.warm_launch import warm_python

LAYERS = _without(BASE, "--num-layers")
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
    # not mapped: Megatron's message (or a bare assert's statement) in one line, with where it failed
    "unmapped check": (1, BASE + ["--lr-decay-samples", "100"],
                       ["Megatron's argument validation refused this command line: expected iteration-based learning "
                        "rate decay (megatron/training/arguments.py:"], None),
    "unmapped bare assert": (1, BASE + ["--save", "/tmp/megatron_async_unused_save", "--save-interval", "2",
                                        "--save-retain-interval", "3"],
                             ["Megatron's argument validation refused this command line: assert "
                              "args.save_retain_interval % args.save_interval == 0 (megatron/training/arguments.py:"],
                             None),
}
ACCEPTED = {  # what the lines above advise
    "--global-batch-size 32": (1, BATCH + ["--micro-batch-size", "8", "--global-batch-size", "32"]),
    "--global-batch-size 40": (1, BATCH + ["--micro-batch-size", "8", "--global-batch-size", "40"]),
    "--global-batch-size 8 at DP=2": (2, BATCH + ["--micro-batch-size", "2", "--global-batch-size", "8"]),
    "--decoder-last-pipeline-num-layers at PP=2": (2, LAYERS + TWO_BW + [
        "--num-layers", "5", "--decoder-last-pipeline-num-layers", str(LAST_OF_5_ON_2)]),
    "--decoder-last-pipeline-num-layers at PP=4": (4, LAYERS + PP4 + [
        "--num-layers", "10", "--decoder-last-pipeline-num-layers", str(LAST_OF_10_ON_4)]),
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
])
def test_a_rank_exits_2_with_our_line_last_and_no_traceback_or_argument_dump(rank, extra, needle):
    proc = _launch_one_rank(rank, BATCH + TWO_BW + extra)
    assert proc.returncode == 2, proc.stdout[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip() and not line.startswith("warm_launch:")]
    ours = [line for line in lines if line.startswith("megatron-async: error:")]
    assert len(ours) == 1 and needle in ours[0] and lines[-1] == ours[0], proc.stdout[-3000:]
    assert "Traceback" not in proc.stdout and "------------------------ arguments" not in proc.stdout, proc.stdout

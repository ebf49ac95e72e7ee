"""Flags the plugin cannot honour are refused by Megatron's own argument validation,
before any process group exists, with a message naming the flag.

Every case goes through Megatron's argument parser and `validate_args` with the
plugin installed, as the launcher's GPT entry runs them first
(megatron_async.check_flags via tests.support.refusals, one process for all
cases). A valid 2bw command line is accepted (the negative control: the
harness does not refuse everything). That a refusal reaches the user as one line
and exit 2 on every rank under torchrun is in tests/test_megatron_loop.py and
tests/test_data_checks.py.
"""

import importlib.util
import json
import os
import shutil
import tempfile

import pytest

from tests.support.refusals import check_in_one_process
from tests.support.warm_launch import warm_python

BASE = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--num-layers", "2",
        "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16", "--max-position-embeddings", "16",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "2", "--eval-interval", "10", "--lr", "1e-3"]
PP2 = ["--pipeline-model-parallel-size", "2"]
TWO_BW = PP2 + ["--pipeline-schedule", "2bw"]
# 2bw with Megatron's --overlap-moe-expert-parallel-comm at EP=2 x PP=2 (4 ranks), m = 16 / (2 x 2) = 4
OVERLAP = BASE + TWO_BW + ["--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall",
                           "--disable-bias-linear", "--expert-model-parallel-size", "2", "--bf16",
                           "--untie-embeddings-and-output-weights", "--global-batch-size", "16",
                           "--overlap-moe-expert-parallel-comm"]
# an empty --save directory (the checkpoint checks run before training; nothing is written)
SAVE = ["--save", os.path.join(tempfile.gettempdir(), "megatron_async_refusals_save"), "--save-interval", "10"]


def _without(args, *flags):
    """args with each flag (and its value, when it takes one) removed."""
    out, skip = [], False
    for i, a in enumerate(args):
        if skip:
            skip = False
            continue
        if a in flags:
            skip = i + 1 < len(args) and not args[i + 1].startswith("--")
            continue
        out.append(a)
    return out


# name: (world size, command line, text the one-line message must contain)
CASES = {
    "no learning rate": (1, _without(BASE, "--lr"), "--lr is required"),
    "--save without --save-interval": (1, BASE + ["--save", "/tmp/megatron_async_unused_save"],
                                       "--save /tmp/megatron_async_unused_save needs --save-interval N"),
    "unknown schedule": (1, BASE + ["--pipeline-schedule", "zigzag"], "--pipeline-schedule 'zigzag'"),
    "simulation-only schedule": (2, BASE + PP2 + ["--pipeline-schedule", "gpipe"], "can only be simulated"),
    "schedule Megatron would not run": (2, BASE + PP2 + ["--pipeline-schedule", "no-pipelining"],
                                        "Megatron runs '1f1b'"),
    "2bw without pipelining": (1, BASE + ["--pipeline-schedule", "2bw"], "--pipeline-model-parallel-size > 1"),
    "weight prediction with tied embeddings": (2, BASE + TWO_BW + ["--delay-correction", "predict"],
                                               "--delay-correction predict needs --untie-embeddings-and-output-weights"),
    "rerun state machine, set explicitly": (2, BASE + TWO_BW + ["--rerun-mode", "validate_results"],
                                            "--rerun-mode must be disabled"),
    "tied MTP saved as torch_dist (Megatron cannot)": (2, BASE + PP2 + SAVE + [
        "--ckpt-format", "torch_dist", "--mtp-num-layers", "1", "--position-embedding-type", "rope"],
        "Megatron-Core 0.19.2 cannot save it"),
    "parameter dumps of a tied model": (2, BASE + TWO_BW + ["--save-params-interval", "1"],
                                        "--save-params-interval with tied embeddings"),
    "gradient dumps": (2, BASE + TWO_BW + ["--save-wgrads-interval", "1"], "--save-wgrads-interval"),
    "MTP with a pipeline layout": (2, BASE + TWO_BW + [
        "--mtp-num-layers", "1", "--position-embedding-type", "rope",
        "--pipeline-model-parallel-layout", "Et|tL"], "--pipeline-model-parallel-layout with --mtp-num-layers"),
    "weight prediction with multi-token prediction": (2, BASE + TWO_BW + [
        "--delay-correction", "predict", "--untie-embeddings-and-output-weights", "--mtp-num-layers", "1",
        "--position-embedding-type", "rope"], "and no --mtp-num-layers"),
    "per-token loss": (2, BASE + TWO_BW + ["--calculate-per-token-loss"], "--calculate-per-token-loss"),
    "fp16 loss scaling": (2, BASE + TWO_BW + ["--fp16"], "--fp16"),
    "parameter norm": (2, BASE + TWO_BW + ["--log-params-norm"], "--log-params-norm"),
    "straggler detector": (2, BASE + TWO_BW + ["--log-straggler"], "--log-straggler"),
    "batch-size ramp-up": (2, _without(BASE, "--global-batch-size") + TWO_BW + [
        "--global-batch-size", "16", "--rampup-batch-size", "8", "8", "100"], "--rampup-batch-size"),
    "step batch-size schedule": (2, _without(BASE, "--global-batch-size") + TWO_BW + [
        "--step-batch-size-schedule", "0:8 64:16"], "--step-batch-size-schedule"),
    "cuda graphs": (2, BASE + TWO_BW + ["--cuda-graph-impl", "local"], "--cuda-graph-impl"),
    "fp8 without Transformer Engine": (1, BASE + ["--fp8-format", "hybrid"], "--fp8-format hybrid"),
    "asynchronous saves": (2, BASE + TWO_BW + SAVE + ["--async-save", "--use-persistent-ckpt-worker"],
                           "--async-save"),
    "virtual pipeline stages": (2, _without(BASE, "--num-layers") + TWO_BW + [
        "--num-layers", "4", "--num-virtual-stages-per-pipeline-rank", "2"], "virtual pipeline stages"),
    "timing barriers": (2, BASE + TWO_BW + ["--timing-log-level", "1"], "--timing-log-level"),
    "too few microbatches": (4, _without(BASE, "--num-layers", "--global-batch-size") + [
        "--num-layers", "4", "--global-batch-size", "4", "--pipeline-model-parallel-size", "4",
        "--pipeline-schedule", "2bw"], "at least 3 microbatches"),
    "overlapped reduce with fewer microbatches than stages": (4, _without(BASE, "--num-layers", "--global-batch-size") + [
        "--num-layers", "4", "--global-batch-size", "6", "--pipeline-model-parallel-size", "4",
        "--pipeline-schedule", "2bw", "--overlap-grad-reduce"], "as many microbatches per batch as stages (3 < 4)"),
    "simulated delay with pipelining": (2, BASE + PP2 + ["--simulated-delay", "1"], "--simulated-delay"),
    "simulated delay with 2bw": (2, BASE + TWO_BW + ["--simulated-delay", "1"],
                                 "--simulated-delay cannot be combined with --pipeline-schedule 2bw"),
    "stage delays that do not split the layers": (1, BASE + ["--simulated-delay", "1,0,0"], "--num-layers (2)"),
    "stage delays vs stages": (1, BASE + ["--simulated-delay", "1,0", "--simulated-pipeline-stages", "1"],
                               "lists 2 stage delays"),
    "simulated stages without a delay": (1, BASE + ["--simulated-pipeline-stages", "2"], "needs --simulated-delay"),
    "simulated delay with per-token loss": (1, BASE + ["--simulated-delay", "1", "--calculate-per-token-loss"],
                                            "--calculate-per-token-loss"),
    "stale-global clipping without 2bw": (2, BASE + PP2 + ["--clip-grad-mode", "stale-global"],
                                          "--clip-grad-mode stale-global needs --pipeline-schedule 2bw"),
    "stale-global clipping without clipping": (2, BASE + TWO_BW + ["--clip-grad-mode", "stale-global",
                                                                   "--clip-grad", "0"], "needs --clip-grad > 0"),
    "negative EF lambda": (1, BASE + ["--simulated-delay", "1", "--delay-correction", "ef", "--ef-lambda", "-0.5"],
                           "--ef-lambda"),
    "correction without a delay": (1, BASE + ["--delay-correction", "ef"], "needs a delayed gradient"),
    "DC-ASGD with a two-step delay": (1, BASE + ["--simulated-delay", "2", "--delay-correction", "dc-asgd"],
                                      "models a one-step delay"),
    "negative DC lambda": (1, BASE + ["--simulated-delay", "1", "--delay-correction", "dc-asgd", "--dc-lambda", "-1"],
                           "--dc-lambda"),
    "negative prediction alpha": (1, BASE + ["--simulated-delay", "1", "--delay-correction", "predict",
                                             "--prediction-alpha", "-1"], "--prediction-alpha"),
    "Nesterov beta of 1": (1, BASE + ["--simulated-delay", "1", "--delay-correction", "nesterov",
                                      "--nesterov-beta", "1"], "--nesterov-beta"),
    "Nesterov twice": (1, BASE + ["--simulated-delay", "1", "--delay-correction", "nesterov", "--optimizer", "muon",
                                  "--muon-nesterov"], "--muon-nesterov"),
    "fp8 parameters": (2, BASE + TWO_BW + ["--fp8-param-gather", "--use-distributed-optimizer"],
                       "--fp8-param-gather"),
    # Megatron's TransformerConfig's checks of --overlap-moe-expert-parallel-comm, made by the plugin under 2bw
    "MoE all-to-all overlap without expert parallelism": (4, OVERLAP + ["--expert-model-parallel-size", "1"],
                                                          "set --expert-model-parallel-size > 1"),
    "MoE all-to-all overlap, allgather dispatcher": (4, OVERLAP + ["--moe-token-dispatcher-type", "allgather"],
                                                     "needs --moe-token-dispatcher-type alltoall or flex"),
    "MoE all-to-all overlap, full recompute": (4, OVERLAP + ["--recompute-granularity", "full", "--recompute-method",
                                                             "uniform", "--recompute-num-layers", "1"],
                                               "--recompute-granularity full recomputes"),
    "MoE all-to-all overlap in fp32": (4, _without(OVERLAP, "--bf16"), "--overlap-moe-expert-parallel-comm needs "
                                                                       "--bf16"),
    "MoE all-to-all overlap, two MTP layers": (4, OVERLAP + ["--mtp-num-layers", "2", "--position-embedding-type",
                                                             "rope"], "--mtp-num-layers 2: the combined step runs"),
    "MoE all-to-all overlap, fewer than 2p-1 microbatches": (4, OVERLAP + ["--global-batch-size", "8"],
                                                             "needs at least 2p-1 = 3 microbatches"),
    "MoE all-to-all overlap, overlapped reduce at 2p-1 microbatches": (
        4, OVERLAP + ["--global-batch-size", "12", "--overlap-grad-reduce"], "need more microbatches per batch"),
    "MoE all-to-all overlap, early attention release": (4, OVERLAP + ["--ep-overlap-early-attn-memory-release"],
                                                        "--ep-overlap-early-attn-memory-release is checked"),
    "expert wgrad overlap": (2, BASE + TWO_BW + ["--overlap-dispatch-backward-with-experts-wgrad"],
                             "--overlap-dispatch-backward-with-experts-wgrad"),
    "deferred embedding wgrad": (2, BASE + TWO_BW + ["--defer-embedding-wgrad-compute"],
                                 "--defer-embedding-wgrad-compute"),
    "activation offloading": (2, BASE + TWO_BW + ["--cpu-offloading-num-layers", "1"], "--cpu-offloading-num-layers"),
    "ring-exchange p2p": (2, BASE + TWO_BW + ["--use-ring-exchange-p2p"], "--use-ring-exchange-p2p"),
    "p2p warm-up flush overlap": (2, BASE + TWO_BW + ["--overlap-p2p-communication-warmup-flush"],
                                  "--overlap-p2p-communication-warmup-flush"),
    "optimizer CUDA graph": (2, BASE + TWO_BW + ["--optimizer-cuda-graph"], "--optimizer-cuda-graph"),
    "optimizer CUDA graph, simulated delay": (1, BASE + ["--simulated-delay", "1", "--optimizer-cuda-graph"],
                                              "--optimizer-cuda-graph"),
    "EF with the precision-aware optimizer": (2, BASE + TWO_BW + ["--bf16", "--use-distributed-optimizer",
                                                                  "--use-precision-aware-optimizer",
                                                                  "--delay-correction", "ef"],
                                              "--delay-correction ef with --use-precision-aware-optimizer"),
    "unknown delay correction": (1, BASE + ["--delay-correction", "sgd"], "--delay-correction"),
    "layer-wise Muon in fp32": (4, BASE + TWO_BW + ["--optimizer", "muon", "--use-distributed-optimizer"],
                                "add --bf16"),
    "Newton-Schulz steps": (1, BASE + ["--optimizer", "muon", "--muon-num-ns-steps", "0"], "--muon-num-ns-steps"),
    "coefficient set": (1, BASE + ["--optimizer", "muon", "--muon-coefficient-type", "nonsense"],
                        "--muon-coefficient-type 'nonsense'"),
    "unknown optimizer": (1, BASE + ["--optimizer", "adamax9000"], "--optimizer"),
    "optimizer that cannot step": (1, BASE + ["--optimizer", "adaptive_muon"], "--optimizer 'adaptive_muon'"),
    "exit signal that is no signal": (1, BASE + ["--exit-signal", "SIGBOGUS"], "'SIGBOGUS' is no signal"),
}
REFUSED_BY = {"unknown delay correction": "argparse", "unknown optimizer": "argparse",
              "exit signal that is no signal": "argparse"}  # else our checks
# Transformer Engine's layers: refused where TE does not import (this machine), never where it does
TE_LAYERS = ["--transformer-impl", "transformer_engine"]
TE_IMPORTS = importlib.util.find_spec("transformer_engine") is not None
if not TE_IMPORTS:
    CASES["Transformer Engine's layers without Transformer Engine"] = (
        1, BASE + TE_LAYERS, "install the transformer-engine package (with its PyTorch extension), or pass "
                             "--transformer-impl local")
ACCEPTED = {
    "2bw": (2, BASE + TWO_BW),
    "2bw, muon + EF, distributed optimizer": (4, BASE + TWO_BW + ["--optimizer", "muon", "--delay-correction", "ef",
                                                                  "--use-distributed-optimizer", "--bf16"]),
    "simulated stage delays": (1, BASE + ["--simulated-delay", "1,0"]),
    "2bw, weight prediction, untied": (2, BASE + TWO_BW + ["--delay-correction", "predict",
                                                           "--untie-embeddings-and-output-weights"]),
    # Megatron's default tied embeddings (tests/test_tied_embeddings.py trains them)
    "2bw, parameter dumps of an untied model": (2, BASE + TWO_BW + ["--save-params-interval", "1",
                                                                    "--untie-embeddings-and-output-weights"]),
    "2bw, multi-token prediction": (2, BASE + TWO_BW + ["--mtp-num-layers", "1", "--position-embedding-type",
                                                          "rope"]),
    "2bw, tied embeddings, PP=4": (4, _without(BASE, "--num-layers", "--global-batch-size") + [
        "--num-layers", "4", "--global-batch-size", "16", "--pipeline-model-parallel-size", "4",
        "--pipeline-schedule", "2bw"]),
    "2bw, tied embeddings, PP=8": (8, _without(BASE, "--num-layers", "--global-batch-size") + [
        "--num-layers", "8", "--global-batch-size", "32", "--pipeline-model-parallel-size", "8",
        "--pipeline-schedule", "2bw"]),
    "simulated delay, DC-ASGD": (1, BASE + ["--simulated-delay", "1", "--delay-correction", "dc-asgd"]),
    "2bw, muon, Nesterov look-ahead": (2, BASE + TWO_BW + ["--optimizer", "muon", "--delay-correction", "nesterov"]),
    "2bw, stale-global clipping": (2, BASE + TWO_BW + ["--clip-grad-mode", "stale-global"]),
    "2bw, exit signal handler and duration": (2, BASE + TWO_BW + ["--exit-signal-handler", "--exit-duration-in-mins",
                                                                  "60"]),
    "2bw, Ctrl-C as the exit signal, by number": (2, BASE + TWO_BW + ["--exit-signal-handler", "--exit-signal",
                                                                      "2"]),
    "2bw saving torch_dist": (2, BASE + TWO_BW + SAVE + ["--ckpt-format", "torch_dist"]),
    "2bw saving torch": (2, BASE + TWO_BW + SAVE + ["--ckpt-format", "torch"]),
    "Megatron's 1F1B": (2, BASE + PP2 + ["--pipeline-schedule", "1f1b"]),
    "2bw, the recipes' distributed optimizer with both overlaps": (4, BASE + TWO_BW + [
        "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]),
    "2bw, overlapped reduce, fewer microbatches than stages, no fusion": (4, _without(
        BASE, "--num-layers", "--global-batch-size") + ["--num-layers", "4", "--global-batch-size", "6",
                                                        "--pipeline-model-parallel-size", "4", "--pipeline-schedule",
                                                        "2bw", "--overlap-grad-reduce",
                                                        "--no-gradient-accumulation-fusion"]),
    "2bw, overlapped reduce, as many microbatches as stages": (4, _without(
        BASE, "--num-layers", "--global-batch-size") + ["--num-layers", "4", "--global-batch-size", "8",
                                                        "--pipeline-model-parallel-size", "4", "--pipeline-schedule",
                                                        "2bw", "--overlap-grad-reduce"]),
    # Megatron's TransformerConfig would ask for virtual stages (megatron_lm/adapter/combined_step_flags.py)
    "2bw, MoE all-to-all overlap at EP=2": (4, OVERLAP),
    "2bw, MoE all-to-all overlap, overlapped reduce at 2p microbatches": (4, OVERLAP + ["--overlap-grad-reduce"]),
    "lion": (1, BASE + ["--optimizer", "lion"]),
    "soap": (1, BASE + ["--optimizer", "soap"]),
}
if TE_IMPORTS:
    ACCEPTED["Transformer Engine's layers where it is installed"] = (1, BASE + TE_LAYERS)


def _data_cases(small_corpus, tmp_path):
    """Refusals of data that Megatron would only meet after the process groups exist."""
    data = _without(BASE, "--mock-data", "--tokenizer-type", "--vocab-size")
    sp = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(small_corpus / "tokenizer.model")]
    # a .bin cut short (a copy that did not finish), next to its whole .idx
    whole = (small_corpus / "train_text_document.bin").read_bytes()
    (tmp_path / "truncated_text_document.bin").write_bytes(whole[:len(whole) // 2])
    shutil.copyfile(small_corpus / "train_text_document.idx", tmp_path / "truncated_text_document.idx")
    return {
        "truncated dataset": (1, data + sp + ["--train-data-path", str(tmp_path / "truncated_text_document")],
                              "the .bin and .idx do not belong together"),
        "missing dataset": (1, data + sp + ["--train-data-path", "/nonexistent/train_text_document"],
                            "--train-data-path"),
        "missing tokenizer": (1, data + ["--train-data-path", str(small_corpus / "train_text_document"),
                                         "--tokenizer-type", "SentencePieceTokenizer",
                                         "--tokenizer-model", "/nonexistent/tokenizer.model"], "--tokenizer-model"),
        "tokenizer directory": (1, data + ["--train-data-path", str(small_corpus / "train_text_document"),
                                           "--tokenizer-type", "SentencePieceTokenizer",
                                           "--tokenizer-model", str(small_corpus)],
                                f"is a directory; --tokenizer-type SentencePieceTokenizer needs the model file itself, "
                                f"e.g. --tokenizer-model {small_corpus / 'tokenizer.model'}"),
        "validation split under one batch": (1, _without(data, "--seq-length", "--max-position-embeddings") + sp + [
            "--seq-length", "2048", "--max-position-embeddings", "2048",
            "--train-data-path", str(small_corpus / "train_text_document"),
            "--valid-data-path", str(small_corpus / "valid_text_document")],
            "--global-batch-size 8 x --seq-length 2048 + 1 = 16,385"),
    }


@pytest.fixture(scope="module")
def results(small_corpus, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("refusals")
    cases = {name: {"world": w, "argv": argv} for name, (w, argv, _) in CASES.items()}
    cases.update({name: {"world": w, "argv": argv} for name, (w, argv, _) in _data_cases(small_corpus, tmp_path).items()})
    cases.update({name: {"world": w, "argv": argv} for name, (w, argv) in ACCEPTED.items()})
    return check_in_one_process(cases, tmp_path), _data_cases(small_corpus, tmp_path)


@pytest.mark.parametrize("name", list(CASES) + ["missing dataset", "missing tokenizer", "tokenizer directory",
                                                "truncated dataset", "validation split under one batch"])
def test_refused_before_training_naming_the_flag(results, name):
    found, data_cases = results
    needle = (CASES.get(name) or data_cases[name])[2]
    assert found[name]["refused"], f"{name}: accepted"
    error = found[name]["error"]
    assert needle in error and "\n" not in error.strip(), error
    # our guard, not Megatron's own check or argparse naming the same flag
    assert found[name]["by"] == REFUSED_BY.get(name, "megatron-async"), (found[name]["by"], error)


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_valid_command_lines_are_accepted(results, name):
    assert not results[0][name]["refused"], results[0][name]["error"]


# Flags Megatron's own validation refuses on the CPU before the plugin's check runs
# (they need Transformer Engine, CUDA settings, nvidia-resiliency-ext or FSDP); on GPUs
# the plugin's check is what refuses them under 2bw. Each goes through the plugin's
# validation directly, on arguments parsed by Megatron's parser (with --save, which
# the checkpoint checks need): flag -> (attribute, value).
MEGATRON_REFUSES_FIRST = {
    "--fp4-param-gather": ("fp4_param_gather", True),
    "--delay-wgrad-compute": ("delay_wgrad_compute", True),
    "--fine-grained-activation-offloading": ("fine_grained_activation_offloading", True),
    "--use-megatron-fsdp": ("use_megatron_fsdp", True),
    "--ckpt-format torch_dcp": ("ckpt_format", "torch_dcp"),
    "--ckpt-format fsdp_dtensor": ("ckpt_format", "fsdp_dtensor"),
    "--non-persistent-ckpt-type local": ("non_persistent_ckpt_type", "local"),
}


def _refused_after_megatron_entry(rank, world_size, flag):
    """In a child process: prepare() installs the hooks and the CPU emulation for good,
    which must not leak into the pytest worker's other modules (test_cpu_emulation)."""
    from megatron_async.check_flags import parse, prepare
    from megatron_async.megatron_lm.adapter.flags import FlagError, validate

    prepare()
    args = parse(BASE + TWO_BW + SAVE, 2, cpu_flags=True)
    validate(args)  # negative control: the same arguments pass without the flag
    name, value = MEGATRON_REFUSES_FIRST[flag]
    setattr(args, name, value)
    try:
        validate(args)
    except FlagError as error:
        return str(error)
    return None


@pytest.mark.parametrize("flag", list(MEGATRON_REFUSES_FIRST))
def test_flags_megatron_refuses_on_cpu_are_refused_by_2bw_too(flag):
    from tests.support.multiprocess import run_distributed

    (error,) = run_distributed(_refused_after_megatron_entry, 1, flag)
    assert error is not None and flag in error, error


RERUN_CASES = [("2bw", None, "disabled"), ("2bw", "disabled", "disabled"), ("1f1b", None, "validate_results"),
               ("1f1b", "report_stats", "report_stats")]


@pytest.fixture(scope="module")
def resolved_rerun_modes():
    """Each case's output of Megatron's parse with the plugin, one process for all four
    (importing Megatron costs seconds a process; parse() starts from the command line each time)."""
    argvs = [BASE + PP2 + ["--pipeline-schedule", schedule] + (["--rerun-mode", given] if given else [])
             for schedule, given, _ in RERUN_CASES]
    out = warm_python("tests.support.parse_each", ["2", "rerun_mode", json.dumps(argvs)], 300)
    assert out.returncode == 0, out.stdout[-3000:]
    parts = out.stdout.split("=== case\n")[1:]
    assert len(parts) == len(RERUN_CASES), out.stdout[-3000:]
    return dict(zip(RERUN_CASES, parts))


@pytest.mark.parametrize("schedule, given, expected", RERUN_CASES)
def test_2bw_sets_rerun_mode_only_where_megatrons_default_was_in_the_way(schedule, given, expected,
                                                                         resolved_rerun_modes):
    """Without --rerun-mode, 2bw runs with it disabled and says so in one line; Megatron's own
    schedule keeps Megatron's default (validate_results), and a value typed is kept (a typed
    value 2bw cannot honour is refused: CASES "rerun state machine, set explicitly")."""
    out = resolved_rerun_modes[(schedule, given, expected)]
    assert f"rerun_mode={expected!r} str" in out, out[-2000:]
    notice = "megatron-async: --pipeline-schedule 2bw sets --rerun-mode disabled"
    assert (notice in out) == (schedule == "2bw" and given is None), out[-2000:]

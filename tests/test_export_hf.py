"""`megatron-async-export-hf` on a 2bw run of the plugin's small GPT, checked by transformers and lm-eval.

One run (2bw, PP=2, tied embeddings, torch_dist, fp32 on the CPU, the small prepared corpus)
serves every test here:
- Exported, loaded with transformers' `AutoModelForCausalLM` (GPT2LMHeadModel), its loss on
  the tokens of Megatron's evaluation after training equals the validation loss the run
  logged, 1e-4 relative (observed 1e-7). Control: the 2bw stash's weights W(T-1) exported
  instead of the live W(T) give a larger difference.
- lm-eval's word perplexity on the held-out documents agrees with the validation loss as
  docs/export_hf.md derives it, exp(loss x tokens / words), within 1% of the loss (the two
  cut the same tokens into different windows). Control: the untrained model's loss
  (iteration 1) is outside that.
- Bad input is refused naming what is wrong, before any weight is read and anything is
  written: no tracker, a torn checkpoint, an architecture no class computes, an `--out`
  that holds a model.
"""

import copy
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from test_megatron_loop import CPU
from tests.support.warm_launch import warm_python, warm_run

SEQ, GBS = 32, 8
MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", str(SEQ),
         "--max-position-embeddings", str(SEQ), "--micro-batch-size", "2", "--global-batch-size", str(GBS),
         "--hidden-dropout", "0", "--attention-dropout", "0", "--position-embedding-type", "learned_absolute"]
ITERS = 30
RTOL = 1e-4
LM_EVAL_RTOL = 0.01
TIMEOUT_S = 300


def train(tmp, corpus, model, extra, eval_iters, nproc=2) -> dict:
    """A 2bw PP=2 run on the prepared corpus that saves at its end: its checkpoint folder and
    the validation loss Megatron logged after training."""
    metrics = tmp / "metrics.jsonl"
    argv = ["--gpt", *CPU, *model, "--train-iters", str(ITERS), "--lr", "1e-2", "--lr-decay-style", "constant",
            "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", str(eval_iters),
            "--train-data-path", str(corpus / "train_text_document"),
            "--valid-data-path", str(corpus / "valid_text_document"),
            "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(corpus / "tokenizer.model"),
            "--num-workers", "0", "--rerun-mode", "disabled", "--metrics-json", str(metrics),
            "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw",
            "--save", str(tmp / "ckpt"), "--save-interval", "1000", *extra]
    proc = warm_run("megatron_async.launch", argv, nproc, TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-4000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {"ckpt": tmp / "ckpt", "iteration": tmp / "ckpt" / f"iter_{ITERS:07d}",
            "val_loss": next(r["final_val_loss"] for r in records if "final_val_loss" in r),
            "first_loss": next(r["lm_loss"] for r in records if "lm_loss" in r)}


def export_cli(load, out, *extra):
    return warm_python("megatron_async.megatron_lm.export.cli", ["--load", str(load), "--out", str(out), *extra],
                       TIMEOUT_S)


def hf_losses(tmp, iteration, *models, extra=()) -> dict:
    out = tmp / "losses.json"
    proc = warm_python("tests.support.hf_validation_loss", [str(iteration), str(out), *map(str, models), *extra],
                       TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def run(tmp_path_factory, small_corpus):
    """The run, with Megatron's evaluation after training reading every window of the held-out split once."""
    stats = json.loads((small_corpus / "stats.json").read_text())
    windows = (stats["splits"]["valid"]["tokens"] - 1) // SEQ
    done = train(tmp_path_factory.mktemp("gpt_run"), small_corpus, MODEL, ["--ckpt-format", "torch_dist"],
                 windows // GBS)
    return {**done, "eval_tokens": windows // GBS * GBS * SEQ}


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory):
    out = tmp_path_factory.mktemp("gpt_export") / "hf"
    proc = export_cli(run["ckpt"], out)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "as GPT2LMHeadModel" in proc.stdout and "with its tokenizer" in proc.stdout
    return out


def test_the_folder_holds_a_tied_gpt2_with_its_tokenizer(exported):
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer.model"):
        assert (exported / name).is_file(), name
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["tie_word_embeddings"] is True
    assert config["activation_function"] == "gelu"  # the run's unfused GELU (--no-bias-gelu-fusion on the CPU)


def test_transformers_loss_equals_megatrons_validation_loss_and_the_stash_does_not(run, exported, tmp_path):
    stash = tmp_path / "stash"
    proc = warm_python("tests.support.export_version", ["stash", str(run["ckpt"]), str(stash)], TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-4000:]
    result = hf_losses(tmp_path, run["iteration"], exported, stash)
    live, older = result["losses"]
    assert result["tokens"] == run["eval_tokens"]
    assert abs(live - run["val_loss"]) <= RTOL * run["val_loss"], (live, run["val_loss"])
    assert abs(older - run["val_loss"]) > RTOL * run["val_loss"], (older, run["val_loss"])


def test_lm_eval_word_perplexity_agrees_with_the_validation_loss(run, exported, small_corpus, text_files, tmp_path):
    import sentencepiece as spm
    import transformers

    stats = json.loads((small_corpus / "stats.json").read_text())["splits"]["valid"]
    folder = Path(text_files[0]).parent
    docs = [(folder / name).read_text() for name in stats["names"]]
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    sp = spm.SentencePieceProcessor(model_file=str(small_corpus / "tokenizer.model"))
    assert [tokenizer(d)["input_ids"] for d in docs] == [sp.encode(d) for d in docs]  # as the corpus was prepared

    out = tmp_path / "lm_eval.json"
    proc = warm_python("tests.support.held_out_lm_eval", [str(exported), str(small_corpus), str(folder),
                                                           str(tmp_path / "work"), str(out)], TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-4000:]
    result = json.loads(out.read_text())
    tokens = stats["tokens"] - stats["documents"]  # each document's end-of-document token is not text
    derived = math.exp(run["val_loss"] * tokens / result["words"])
    per_token = math.log(result["word_perplexity"]) * result["words"] / tokens
    assert abs(per_token - run["val_loss"]) <= LM_EVAL_RTOL * run["val_loss"], (result, derived, run["val_loss"])
    assert abs(per_token - run["first_loss"]) > LM_EVAL_RTOL * run["first_loss"]  # control: the untrained model


# Refusals, in this process, on the run's checkpoint (a damaged copy, or its saved arguments
# as another run would have saved them): what is checked before the weights are read. Reading
# them here fails the test, and `--out` must not appear.

def _copy(run, tmp_path) -> Path:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(run["ckpt"], ckpt)
    return ckpt


def _refusal(ckpt, out, monkeypatch, changed_args=None, **kw) -> str:
    """The refusal of exporting `ckpt` to `out`; `changed_args`: the saved arguments as another
    run would have saved them."""
    from megatron_async.megatron_lm.export import ExportError, checkpoint_reader, megatron_model
    from megatron_async.megatron_lm.export.cli import export

    def read(*args, **kwargs):
        raise AssertionError("the weights were read")

    monkeypatch.setattr(checkpoint_reader, "read_weights", read)
    if changed_args:
        saved = megatron_model.saved_args

        def changed(directory):
            args = copy.deepcopy(saved(directory))
            for key, value in changed_args.items():
                setattr(args, key, value)
            return args

        monkeypatch.setattr(megatron_model, "saved_args", changed)
    with pytest.raises(ExportError) as refused:
        export(str(ckpt), str(out), **kw)
    assert not any(p.name.startswith(f".{out.name}.export-") for p in out.parent.iterdir())
    return str(refused.value)


def test_a_folder_without_a_tracker_is_refused(run, tmp_path, monkeypatch):
    ckpt = _copy(run, tmp_path)
    (ckpt / "latest_checkpointed_iteration.txt").unlink()
    message = _refusal(ckpt, tmp_path / "hf", monkeypatch)
    assert "no latest_checkpointed_iteration.txt" in message and "--ckpt-step" in message, message
    assert not (tmp_path / "hf").exists()
    # the same folder with the iteration named is read (up to the weights, here)
    with pytest.raises(AssertionError, match="the weights were read"):
        _refusal(ckpt, tmp_path / "hf", monkeypatch, ckpt_step=ITERS)


@pytest.mark.parametrize("damage", ["missing", "cut short"])
def test_a_torn_checkpoint_is_refused_naming_the_file(run, tmp_path, monkeypatch, damage):
    ckpt = _copy(run, tmp_path)
    shard = sorted((ckpt / f"iter_{ITERS:07d}").glob("*.distcp"))[-1]
    if damage == "missing":
        shard.unlink()
    else:
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    message = _refusal(ckpt, tmp_path / "hf", monkeypatch)
    assert "is torn" in message and shard.name in message, message
    assert not (tmp_path / "hf").exists()


ARCHITECTURES = {  # saved arguments no transformers class mapped here computes, and the flag named
    "moe": ({"num_experts": 4}, "--num-experts 4: an MoE model"),
    "qk layernorm": ({"qk_layernorm": True}, "--qk-layernorm:"),
    "rmsnorm without swiglu": ({"normalization": "RMSNorm", "position_embedding_type": "rope"}, "--swiglu:"),
    "rope with layernorm": ({"position_embedding_type": "rope"}, "--position-embedding-type rope:"),
    "gqa with layernorm": ({"group_query_attention": True, "num_query_groups": 2}, "--num-query-groups 2:"),
    "squared relu": ({"squared_relu": True}, "--squared-relu:"),
}


@pytest.mark.parametrize("case", list(ARCHITECTURES))
def test_an_architecture_no_class_computes_is_refused_naming_the_flag(run, tmp_path, monkeypatch, case):
    changes, expected = ARCHITECTURES[case]
    message = _refusal(run["ckpt"], tmp_path / "hf", monkeypatch, changes)
    assert message.startswith(expected), message
    assert not (tmp_path / "hf").exists()


def test_an_out_folder_that_holds_a_model_is_refused(run, tmp_path, monkeypatch):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("{}")
    message = _refusal(run["ckpt"], out, monkeypatch)
    assert f"--out {out}: already holds a model (config.json)" in message, message
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]


def test_a_missing_tokenizer_model_is_refused(run, tmp_path, monkeypatch):
    message = _refusal(run["ckpt"], tmp_path / "hf", monkeypatch, {"tokenizer_model": str(tmp_path / "moved.model")})
    assert message.startswith(f"--tokenizer-model {tmp_path / 'moved.model'}:"), message


def test_the_command_refuses_with_one_error_line_and_exit_2(run, tmp_path):
    ckpt = _copy(run, tmp_path)
    (ckpt / "latest_checkpointed_iteration.txt").unlink()
    proc = export_cli(ckpt, tmp_path / "hf")
    assert proc.returncode == 2, proc.stdout[-4000:]
    errors = [line for line in proc.stdout.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("megatron-async: error: --load "), errors
    assert not (tmp_path / "hf").exists()


def test_the_gelu_mapped_is_the_one_megatrons_mlp_applies():
    """Megatron fuses GELU with the bias as its tanh approximation (`bias_gelu_impl`): exported as
    transformers' `gelu_new`; unfused it is torch's exact GELU, `gelu`. Control: the two differ."""
    from types import SimpleNamespace

    from megatron.core.fusions.fused_bias_gelu import bias_gelu_impl
    from transformers.activations import ACT2FN

    from megatron_async.megatron_lm.export.hf_architecture import gelu_name

    x = torch.linspace(-6, 6, 2001, dtype=torch.float64)
    fused = bias_gelu_impl(x, torch.zeros(()))
    fused_config = SimpleNamespace(bias_activation_fusion=True, add_bias_linear=True)
    plain_config = SimpleNamespace(bias_activation_fusion=False, add_bias_linear=True)
    assert torch.allclose(ACT2FN[gelu_name(fused_config)](x), fused, rtol=0, atol=1e-7)
    assert torch.allclose(ACT2FN[gelu_name(plain_config)](x), torch.nn.functional.gelu(x), rtol=0, atol=1e-12)
    assert (ACT2FN["gelu"](x) - fused).abs().max() > 1e-4


def test_every_refusal_names_one_of_megatrons_flags():
    import argparse

    from megatron.training.arguments import add_megatron_arguments

    from megatron_async.megatron_lm.export.hf_architecture import NEUTRAL, flag

    dests = {a.dest: a.option_strings for a in add_megatron_arguments(argparse.ArgumentParser())._actions}
    named = [dest for dest, _ in NEUTRAL] + ["position_embedding_type", "swiglu", "normalization",
                                             "use_te_activation_func", "num_query_groups", "kv_channels"]
    assert [d for d in named if d not in dests] == []
    assert all(flag(d) in dests[d] for d in named)


def test_an_export_that_fails_while_writing_leaves_no_folder(tmp_path):
    """The folder is staged beside `--out` and renamed only once complete: a failure after the
    weights were written (here the tokenizer's) leaves neither `--out` nor the staging folder.
    Control: the same write without the failing part creates `--out`."""
    import transformers

    from megatron_async.megatron_lm.export import hf_folder

    config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=4, dtype="float32")
    state = transformers.GPT2LMHeadModel(config).state_dict()
    with pytest.raises(Exception):
        hf_folder.write(str(tmp_path / "hf"), config, state, str(tmp_path / "missing.model"))
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    hf_folder.write(str(tmp_path / "hf"), config, state, None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"] and (tmp_path / "hf" / "model.safetensors").is_file()

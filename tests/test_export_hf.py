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
  written: no tracker, a torn checkpoint (a file missing or cut short, or a weight's chunk
  missing from torch_dist's index, which the layer-by-layer read would otherwise leave
  unread), a file whose bytes changed since the save (training's checksum check;
  `--no-checkpoint-checksums` skips it), an architecture no class computes, an `--out` that
  holds a model (one file or shards), or whose parent is missing or read-only, a
  `--max-shard-size` that is no size (before the checkpoint is read).
- A write the file system refuses (read-only, full, a permission; a disk that fills between
  shards) is one refusal naming `--out` and the cause, with nothing left there.
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
    eval_iters = whole_split_eval_iters(small_corpus)
    done = train(tmp_path_factory.mktemp("gpt_run"), small_corpus, MODEL, ["--ckpt-format", "torch_dist"], eval_iters)
    return {**done, "eval_tokens": eval_iters * GBS * SEQ}


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
    lm_eval_agrees(run, exported, small_corpus, text_files, tmp_path)


def lm_eval_agrees(run, exported, small_corpus, text_files, tmp_path) -> dict:
    """lm-eval's word perplexity of `exported` on the held-out documents, as nats per token,
    within LM_EVAL_RTOL of the run's validation loss over the whole held-out split; the
    untrained model's loss (iteration 1) is not."""
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
    return {**result, "per_token": per_token}


def whole_split_eval_iters(small_corpus) -> int:
    """Evaluation iterations after training that read every window of the held-out split once."""
    stats = json.loads((small_corpus / "stats.json").read_text())
    return (stats["splits"]["valid"]["tokens"] - 1) // SEQ // GBS


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
    "moe with biases": ({"num_experts": 4}, "--disable-bias-linear:"),
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


@pytest.mark.parametrize("held", ["config.json", "model-00002-of-00003.safetensors"])
def test_an_out_folder_that_holds_a_model_is_refused(run, tmp_path, monkeypatch, held):
    out = tmp_path / "hf"
    out.mkdir()
    (out / held).write_text("{}")
    message = _refusal(run["ckpt"], out, monkeypatch)
    assert f"--out {out}: already holds a model ({held})" in message, message
    assert sorted(p.name for p in out.iterdir()) == [held]


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


def _drop_from_index(directory: Path, key: str, layer: int | None) -> None:
    """Take `key`'s saved chunk of one layer (or, `layer` None, the whole key) out of torch_dist's
    index (`.metadata`), as in a save torn before every rank's part was recorded; the data files
    stay as they are, so the files' own check finds nothing missing."""
    import pickle

    path = directory / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    if layer is None:
        del metadata.state_dict_metadata[key]
    else:
        chunks = metadata.state_dict_metadata[key].chunks
        chunks.remove(next(chunk for chunk in chunks if chunk.offsets[0] == layer))
    path.write_bytes(pickle.dumps(metadata))


@pytest.mark.parametrize("torn", ["a layer's chunk", "a whole key"])
def test_a_checkpoint_whose_index_lacks_a_weight_is_refused_before_anything_is_written(run, tmp_path, torn):
    """The export reads chunk by chunk; a chunk the index does not hold would leave its part of
    the weight as whatever memory held (exported without a word). Refused, naming the key and
    where, with nothing at `--out` and no staging folder beside it. Checksums are skipped: the
    index changed since the save, which they would name first."""
    ckpt = _copy(run, tmp_path)
    directory = ckpt / f"iter_{ITERS:07d}"
    key = "decoder.layers.self_attention.linear_qkv.weight"
    _drop_from_index(directory, key, 1 if torn == "a layer's chunk" else None)
    (tmp_path / "out").mkdir()
    proc = export_cli(ckpt, tmp_path / "out" / "hf", "--no-checkpoint-checksums")
    assert proc.returncode == 2, proc.stdout[-4000:]
    errors = [line for line in proc.stdout.splitlines() if "error" in line.lower()]
    expected = (f"is torn: no saved chunk holds part of {key} at offset (1, 0, 0)" if torn == "a layer's chunk"
                else f"holds no tensor {key}")
    assert len(errors) == 1 and errors[0].startswith(f"megatron-async: error: --load: {directory}"), errors
    assert expected in errors[0], errors[0]
    assert list((tmp_path / "out").iterdir()) == []


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

    from megatron_async.megatron_lm.export import hf_moe
    from megatron_async.megatron_lm.export.hf_architecture import NEUTRAL, flag

    dests = {a.dest: a.option_strings for a in add_megatron_arguments(argparse.ArgumentParser())._actions}
    named = [dest for dest, _ in NEUTRAL + hf_moe.NEUTRAL] + ["moe_layer_freq", "qk_layernorm", "position_embedding_type", "swiglu", "normalization",
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


# The checkpoint's checksums (training's check, safety/checksum_guard.py) and `--out`'s file
# system, through the command's own entry in this process: its one line and exit code.

def _flip_a_weight(directory: Path, fqn: str = "embedding.word_embeddings.weight") -> Path:
    """XOR 16 bytes in the middle of a model weight's chunk (found through `.metadata`): the file
    keeps its size, so torch_dist's index and the torn-checkpoint check see nothing. Returns the file."""
    from torch.distributed.checkpoint import FileSystemReader

    info = next(info for index, info in FileSystemReader(str(directory)).read_metadata().storage_data.items()
                if index.fqn == fqn)
    path = directory / info.relative_path
    data = bytearray(path.read_bytes())
    middle = info.offset + info.length // 2
    data[middle:middle + 16] = bytes(b ^ 0x7F for b in data[middle:middle + 16])
    path.write_bytes(bytes(data))
    return path


def _command(argv, monkeypatch, capsys, read: str = "weights"):
    """The command's exit code, its `megatron-async: error:` lines and its stdout; reading the
    weights (`read="weights"`) or the checkpoint at all (`read="checkpoint"`) fails the test."""
    from megatron_async.megatron_lm.export import checkpoint_reader
    from megatron_async.megatron_lm.export.cli import main

    def reading(*args, **kwargs):
        raise AssertionError(f"the {read} were read" if read == "weights" else "the checkpoint was read")

    monkeypatch.setattr(checkpoint_reader, "read_weights" if read == "weights" else "locate", reading)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err[-4000:]
    return exited.value.code, [line for line in err.splitlines() if line.startswith("megatron-async: error:")], out


def test_a_checkpoint_whose_bytes_changed_is_refused_naming_the_file_and_the_opt_out(run, tmp_path, monkeypatch,
                                                                                       capsys):
    """16 bytes of the word embeddings XOR-ed: without the check the export writes them (values
    up to 1e37). Refused with the file, as training refuses its resume, before the saved arguments
    are read. Control: the same copy unchanged reaches the weights."""
    from megatron_async.megatron_lm.export import megatron_model

    ckpt = _copy(run, tmp_path)
    with pytest.raises(AssertionError, match="the weights were read"):
        _command(["--load", ckpt, "--out", tmp_path / "hf"], monkeypatch, capsys)
    flipped = _flip_a_weight(ckpt / f"iter_{ITERS:07d}")

    def saved_args(directory):
        raise AssertionError("the saved arguments were read")

    monkeypatch.setattr(megatron_model, "saved_args", saved_args)
    code, errors, _ = _command(["--load", ckpt, "--out", tmp_path / "hf"], monkeypatch, capsys)
    assert code == 2 and len(errors) == 1, errors
    assert f"damaged: {flipped} (its xxh3_64 checksum differs from the one taken at save" in errors[0], errors[0]
    assert errors[0].endswith("; --no-checkpoint-checksums exports it unverified"), errors[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_marker_edited_to_hide_a_change_is_refused_naming_it_and_the_opt_out(run, tmp_path, monkeypatch, capsys):
    """The word embeddings changed and their checksums taken out of megatron_async.json: the
    marker no longer matches the checksum it holds of itself (training's seal), so it is refused
    before the saved arguments are read, rather than exported as a checkpoint without checksums."""
    from megatron_async.megatron_lm.export import megatron_model

    ckpt = _copy(run, tmp_path)
    directory = ckpt / f"iter_{ITERS:07d}"
    _flip_a_weight(directory)
    marker = json.loads((directory / "megatron_async.json").read_text())
    del marker["checksums"]
    (directory / "megatron_async.json").write_text(json.dumps(marker))

    def saved_args(directory):
        raise AssertionError("the saved arguments were read")

    monkeypatch.setattr(megatron_model, "saved_args", saved_args)
    code, errors, _ = _command(["--load", ckpt, "--out", tmp_path / "hf"], monkeypatch, capsys)
    assert code == 2 and len(errors) == 1, errors
    assert f"{directory / 'megatron_async.json'} does not match the checksum it holds of its own content" in errors[0]
    assert "--no-checkpoint-checksums" in errors[0], errors[0]


def test_no_checkpoint_checksums_exports_a_changed_checkpoint_unverified_saying_so(run, tmp_path, monkeypatch,
                                                                                    capsys):
    ckpt = _copy(run, tmp_path)
    _flip_a_weight(ckpt / f"iter_{ITERS:07d}")
    with pytest.raises(AssertionError, match="the weights were read"):
        _command(["--load", ckpt, "--out", tmp_path / "hf", "--no-checkpoint-checksums"], monkeypatch, capsys)
    said = capsys.readouterr().out
    assert f"--no-checkpoint-checksums: the files of {ckpt / f'iter_{ITERS:07d}'} are loaded unverified" in said


def test_an_out_whose_parent_is_missing_is_refused_before_the_checkpoint_is_read(run, tmp_path, monkeypatch,
                                                                                 capsys):
    out = tmp_path / "missing" / "hf"
    code, errors, _ = _command(["--load", run["ckpt"], "--out", out], monkeypatch, capsys, read="checkpoint")
    assert code == 2 and errors == [f"megatron-async: error: --out {out}: its parent folder does not exist"], errors


def test_max_shard_size_reads_sizes_as_hugging_face_writes_them_and_refuses_others(run, tmp_path, monkeypatch,
                                                                                    capsys):
    from megatron_async.megatron_lm.export.safetensors_shards import parse_size

    assert [parse_size(t) for t in ("5GB", "500MB", "2GiB", "1.5KB", "1000")] == [5 * 10**9, 5 * 10**8, 2 * 2**30,
                                                                                 1500, 1000]
    for bad in ("0", "5 potatoes"):
        code, errors, _ = _command(["--load", run["ckpt"], "--out", tmp_path / "hf", "--max-shard-size", bad],
                                   monkeypatch, capsys, read="checkpoint")
        assert code == 2 and len(errors) == 1 and errors[0].startswith(
            f"megatron-async: error: --max-shard-size {bad}: "), errors


def test_an_out_on_a_read_only_file_system_is_refused_before_the_checkpoint_is_read(run, tmp_path, tmpfs,
                                                                                    monkeypatch, capsys):
    out = tmpfs("read_only", "ro,size=1m") / "hf"
    code, errors, _ = _command(["--load", run["ckpt"], "--out", out], monkeypatch, capsys, read="checkpoint")
    assert code == 2 and len(errors) == 1, errors
    assert errors[0].startswith(f"megatron-async: error: --out {out}: its file system is read-only ("), errors[0]
    assert list(out.parent.iterdir()) == []


def _small_gpt2(vocab: int):
    import transformers

    config = transformers.GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=vocab, n_positions=8,
                                     dtype="float32", bos_token_id=0, eos_token_id=0)
    return config, transformers.GPT2LMHeadModel(config).state_dict()


@pytest.mark.parametrize("options, cause", [("ro,size=4m", "its file system is read-only"),
                                            ("size=128k", "no space left on its device")], ids=["read-only", "full"])
def test_a_write_the_file_system_refuses_is_one_refusal_naming_out_and_leaves_nothing(tmp_path, tmpfs, options,
                                                                                      cause):
    """Past the checks before the read (the file system turned read-only, or filled, meanwhile):
    the OSError of a weight file's write becomes the refusal naming `--out` and the cause, and the
    staging folder is removed. Control: the same folder fits a writable tmpfs with room."""
    from megatron_async.megatron_lm.export import ExportError, hf_folder

    config, state = _small_gpt2(vocab=1024)  # about 0.5 MiB of weights
    where = tmpfs("refusing", options)
    with pytest.raises(ExportError) as refused:
        hf_folder.write(str(where / "hf"), config, state, None)
    assert str(refused.value).startswith(f"--out {where / 'hf'}: {cause} (writing the model folder"), refused.value
    assert list(where.iterdir()) == []
    roomy = tmpfs("roomy", "size=4m")
    hf_folder.write(str(roomy / "hf"), config, state, None)
    assert (roomy / "hf" / "model.safetensors").stat().st_size > 128 * 1024


def test_a_disk_that_fills_between_shards_leaves_no_shard_and_no_index(tmp_path, tmpfs):
    """The weights in 64 KB files: the disk (256 KB) fills after some are complete. Refused as
    a full disk naming `--out`; the complete shards and the cut one go with the staging folder,
    and no index is written. Control: a roomy tmpfs gets every shard and the index, which
    transformers loads to the same weights."""
    import transformers

    from megatron_async.megatron_lm.export import ExportError, hf_folder

    config, state = _small_gpt2(vocab=1024)
    state = {key: value for key, value in state.items() if key != "lm_head.weight"}  # tied: saved once
    where = tmpfs("full", "size=256k")
    with pytest.raises(ExportError) as refused:
        hf_folder.write(str(where / "hf"), config, state, None, max_shard_size=64 * 1024)
    assert str(refused.value).startswith(f"--out {where / 'hf'}: no space left on its device (writing"), refused.value
    assert list(where.iterdir()) == []
    roomy = tmpfs("roomy", "size=4m")
    files = hf_folder.write(str(roomy / "hf"), config, state, None, max_shard_size=64 * 1024)
    assert len(files) > 5 and files[-1] == "model.safetensors.index.json", files
    assert sorted(p.name for p in (roomy / "hf").iterdir()) == sorted(files + ["config.json", "generation_config.json"])
    loaded = transformers.GPT2LMHeadModel.from_pretrained(roomy / "hf").state_dict()
    assert all(torch.equal(loaded[key], value) for key, value in state.items())


@pytest.mark.parametrize("failure, cause", [
    (PermissionError(13, "Permission denied"), "permission denied"),  # root's writes pass modes: raised here
    (Exception("No space left on device (os error 28)"), "no space left on its device"),  # as `tokenizers` raises
], ids=["permission", "tokenizers-library"])
def test_every_write_failure_is_the_same_refusal_and_a_defect_is_not(tmp_path, monkeypatch, failure, cause):
    """A failure raised while the tokenizer is written (after the weights): the same refusal,
    nothing left. Control: an exception that is no write failure propagates as it is."""
    from megatron_async.megatron_lm.export import ExportError, hf_folder

    config, state = _small_gpt2(vocab=64)

    def failing(*args, **kwargs):
        raise failure

    monkeypatch.setattr(hf_folder, "_write_tokenizer", failing)
    with pytest.raises(ExportError) as refused:
        hf_folder.write(str(tmp_path / "hf"), config, state, "tokenizer.model")
    assert str(refused.value).startswith(f"--out {tmp_path / 'hf'}: {cause} (writing the model folder"), refused.value
    assert list(tmp_path.iterdir()) == []
    failure = RuntimeError("a defect of the exporter")
    with pytest.raises(RuntimeError, match="a defect of the exporter"):
        hf_folder.write(str(tmp_path / "hf"), config, state, "tokenizer.model")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("defect", [False, True], ids=["out of memory", "control: another RuntimeError"])
def test_an_export_that_runs_out_of_memory_is_one_refusal_and_leaves_nothing(tmp_path, monkeypatch, capsys, defect):
    """The second group's read asks torch's CPU allocator for more than it can give (a real
    allocation that fails): one line naming `--out` and what the export needs, exit 2, the
    shard already begun gone with the staging folder. Control: any other RuntimeError keeps
    its traceback."""
    from megatron_async.megatron_lm.export import cli, hf_folder

    config, state = _small_gpt2(vocab=64)
    names = list(state)

    def groups():
        yield {names[0]: state[names[0]]}
        if defect:
            raise RuntimeError("a defect of the exporter")
        yield {"too big": torch.empty(2**62, dtype=torch.uint8)}

    def export(load, out, *args, **kwargs):
        specs = [(key, tuple(value.shape), value.dtype) for key, value in state.items()]
        hf_folder.write_streamed(out, config, specs, groups(), None)

    monkeypatch.setattr(cli, "export", export)
    out = tmp_path / "hf"
    if defect:
        with pytest.raises(RuntimeError, match="a defect of the exporter"):
            cli.main(["--load", str(tmp_path), "--out", str(out)])
    else:
        with pytest.raises(SystemExit) as stopped:
            cli.main(["--load", str(tmp_path), "--out", str(out)])
        assert stopped.value.code == 2
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1 and lines[0].startswith(
            f"megatron-async: error: --out {out}: the export ran out of memory (DefaultCPUAllocator: can't allocate "
            "memory"), lines
    assert list(tmp_path.iterdir()) == []

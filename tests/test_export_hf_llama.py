"""`megatron-async-export-hf` on a Llama-shaped 2bw run saved in Megatron's torch format.

The SmolLM-360M example's architecture at reduced width (RMSNorm, SwiGLU, RoPE, grouped-query
attention with 3 query heads per key/value head, no biases), untied, 2bw at PP=2 x TP=2
with an uneven split (2 + 1 layers, as the example's --decoder-last-pipeline-num-layers),
saved with --ckpt-format torch: read by one forked process per rank at its own layout, each
rank's share of the fused QKV (whole query groups) and SwiGLU weights joined by Megatron's
own sharded save.
Exported as LlamaForCausalLM, its loss on the tokens of Megatron's evaluation equals the
logged validation loss, 1e-4 relative (observed equal). Control: the same weights with
each query head paired with another key/value group, as a mapping blind to Megatron's
per-group layout would pair them, differ by more. A rank file missing is refused, naming it.
"""

import json
import shutil

import pytest

from test_export_hf import ITERS, export_cli, hf_losses, train

LLAMA = ["--num-layers", "3", "--decoder-last-pipeline-num-layers", "1", "--hidden-size", "48",
         "--num-attention-heads", "6", "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "8",
         "--ffn-hidden-size", "128", "--seq-length", "32", "--max-position-embeddings", "32",
         "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--hidden-dropout", "0", "--attention-dropout", "0"]
RTOL = 1e-4


@pytest.fixture(scope="module")
def run(tmp_path_factory, small_corpus):
    return train(tmp_path_factory.mktemp("llama_run"), small_corpus, LLAMA,
                 ["--ckpt-format", "torch", "--tensor-model-parallel-size", "2"], eval_iters=4, nproc=4)


def test_a_llama_shaped_run_exports_as_llama_with_megatrons_loss(run, tmp_path):
    out = tmp_path / "hf"
    proc = export_cli(run["ckpt"], out)
    assert proc.returncode == 0, proc.stdout[-4000:]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is False
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (6, 2, 8)
    result = hf_losses(tmp_path, run["iteration"], out, extra=["--swap-kv-groups"])
    (live,), (regrouped,) = result["losses"], result["swapped_kv_groups"]
    assert abs(live - run["val_loss"]) <= RTOL * run["val_loss"], (live, run["val_loss"])
    assert abs(regrouped - run["val_loss"]) > RTOL * run["val_loss"], (regrouped, run["val_loss"])


def test_a_torch_format_checkpoint_missing_a_rank_file_is_refused(run, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(run["ckpt"], ckpt)
    (ckpt / f"iter_{ITERS:07d}" / "mp_rank_01_001" / "model_optim_rng.pt").unlink()
    proc = export_cli(ckpt, tmp_path / "hf")
    assert proc.returncode == 2, proc.stdout[-4000:]
    assert "is torn: mp_rank_01_001/model_optim_rng.pt is missing (saved at TP=2 PP=2)" in proc.stdout
    assert not (tmp_path / "hf").exists()

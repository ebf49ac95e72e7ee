"""`megatron-async-export-hf` on an MoE 2bw run of the 10B example's layer, as Qwen3MoeForCausalLM.

The layer of examples/moe_10b at reduced width (RoPE with its --rotary-base, RMSNorm,
SwiGLU experts, QK-norm, top-2 of 4 experts with the aux loss, no biases, untied),
2bw at PP=2 with the experts spread over EP=2 (4 ranks, DP=2), saved as torch_dist: read
back at one stage, a layer at a time, with every expert under its global number. Exported
in safetensors shards with their index (each tensor once, each file within the size), its
loss on the tokens of Megatron's evaluation (every window of the held-out split) equals the
logged validation loss, 1e-4 relative. Controls, each outside that: the 2bw stash's W(T-1)
exported instead of the live W(T), and the live weights with every layer's experts rolled
by one place against the router. lm-eval's word perplexity agrees with the validation loss
as for the dense model (tests/test_export_hf.py). The same layer at 3 layers split 2 + 1
over the stages, saved as --ckpt-format torch (a file per pipeline and expert rank), exports
with the logged validation loss too (control: the experts rolled). The export holds no earlier group when it
reads the next (control: one that keeps them). A bf16 checkpoint saved with a GPU run's
arguments exports every weight bitwise. Router settings Qwen3-MoE does not compute are
refused naming the flag; the multi-token-prediction layers are left out with one line
saying so.
"""

import json
from types import SimpleNamespace

import pytest
import torch

from test_export_hf import TIMEOUT_S, _refusal, export_cli, hf_losses, lm_eval_agrees, train, whole_split_eval_iters
from tests.support.warm_launch import warm_python

MOE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--kv-channels", "8",
       "--ffn-hidden-size", "64", "--seq-length", "32", "--max-position-embeddings", "32",
       "--position-embedding-type", "rope", "--rotary-base", "500000", "--normalization", "RMSNorm", "--swiglu",
       "--disable-bias-linear", "--qk-layernorm", "--untie-embeddings-and-output-weights",
       "--num-experts", "4", "--moe-ffn-hidden-size", "32", "--moe-router-topk", "2",
       "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "0.01",
       "--moe-token-dispatcher-type", "alltoall", "--expert-model-parallel-size", "2",
       "--micro-batch-size", "2", "--global-batch-size", "8", "--hidden-dropout", "0", "--attention-dropout", "0"]
RTOL = 1e-4
ITERS = 8  # enough for the stash's W(T-1) to differ from W(T); fewer than the dense runs' to keep the suite fast
SHARD = "100KB"  # the model's 264 KB of weights in three files, as the 10B's 20 GB would be in five-GB ones


@pytest.fixture(scope="module")
def run(tmp_path_factory, small_corpus):
    """The run, with Megatron's evaluation after training reading every window of the held-out split once."""
    done = train(tmp_path_factory.mktemp("moe_run"), small_corpus, MOE,
                 ["--ckpt-format", "torch_dist", "--train-iters", str(ITERS)],
                 eval_iters=whole_split_eval_iters(small_corpus), nproc=4)
    return {**done, "iteration": done["ckpt"] / f"iter_{ITERS:07d}"}


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory):
    """The run exported in safetensors shards of at most SHARD."""
    out = tmp_path_factory.mktemp("moe_export") / "hf"
    proc = export_cli(run["ckpt"], out, "--max-shard-size", SHARD)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "as Qwen3MoeForCausalLM" in proc.stdout and "multi-token" not in proc.stdout
    assert "(3 shards and model.safetensors.index.json) with its tokenizer" in proc.stdout, proc.stdout[-2000:]
    return out


def test_the_shards_hold_every_tensor_once_within_the_size_and_the_index_names_them(exported):
    from safetensors import safe_open

    index = json.loads((exported / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in exported.glob("*.safetensors"))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    held, sizes = {}, {}
    for name in files:
        with safe_open(str(exported / name), "pt") as f:
            assert f.metadata() == {"format": "pt"}
            held.update({key: name for key in f.keys()})
            sizes[name] = sum(f.get_tensor(key).nbytes for key in f.keys())
    assert index["weight_map"] == held
    assert index["metadata"]["total_size"] == sum(sizes.values())
    assert all(size <= 100_000 for size in sizes.values()), sizes
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in held  # each expert on its own, as transformers saves


def test_an_moe_run_exports_as_qwen3_moe_with_megatrons_loss_and_the_controls_do_not(run, exported, tmp_path):
    out, stash = exported, tmp_path / "stash"
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["tie_word_embeddings"] is False
    assert (config["num_local_experts"], config["num_experts_per_tok"], config["norm_topk_prob"]) == (4, 2, True)
    proc = warm_python("tests.support.export_version", ["stash", str(run["ckpt"]), str(stash)], TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-4000:]
    result = hf_losses(tmp_path, run["iteration"], out, stash, extra=["--permute-experts"])
    (live, older), (permuted, _) = result["losses"], result["permuted_experts"]
    assert abs(live - run["val_loss"]) <= RTOL * run["val_loss"], (live, run["val_loss"])
    assert abs(older - run["val_loss"]) > RTOL * run["val_loss"], (older, run["val_loss"])
    assert abs(permuted - run["val_loss"]) > RTOL * run["val_loss"], (permuted, run["val_loss"])


# the layer at 3 layers split 2 + 1 over the two stages, saved as each rank's own file
UNEVEN = [*MOE[:MOE.index("--num-layers")], "--num-layers", "3", *MOE[MOE.index("--num-layers") + 2:]]


@pytest.fixture(scope="module")
def torch_format_run(tmp_path_factory, small_corpus):
    """The run at 3 layers, 2 on the first stage, saved with --ckpt-format torch."""
    done = train(tmp_path_factory.mktemp("moe_torch_run"), small_corpus, UNEVEN,
                 ["--decoder-first-pipeline-num-layers", "2", "--ckpt-format", "torch", "--train-iters", str(ITERS)],
                 eval_iters=whole_split_eval_iters(small_corpus), nproc=4)
    return {**done, "iteration": done["ckpt"] / f"iter_{ITERS:07d}"}


def test_a_torch_format_run_split_unevenly_over_expert_and_pipeline_ranks_exports_with_megatrons_loss(
        torch_format_run, tmp_path):
    """Every expert rank's file of each stage read at the saved layout (experts under their
    global numbers, layers at the uneven split's offsets). Control: the experts rolled by one."""
    run, out = torch_format_run, tmp_path / "hf"
    files = sorted(p.name for p in run["iteration"].iterdir() if p.name.startswith("mp_rank_"))
    assert files == ["mp_rank_00_000_000", "mp_rank_00_000_001", "mp_rank_00_001_000", "mp_rank_00_001_001"], files
    proc = export_cli(run["ckpt"], out)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "as Qwen3MoeForCausalLM" in proc.stdout, proc.stdout[-2000:]
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 3
    result = hf_losses(tmp_path, run["iteration"], out, extra=["--permute-experts"])
    (live,), (permuted,) = result["losses"], result["permuted_experts"]
    assert abs(live - run["val_loss"]) <= RTOL * run["val_loss"], (live, run["val_loss"])
    assert abs(permuted - run["val_loss"]) > RTOL * run["val_loss"], (permuted, run["val_loss"])


REFUSED = {  # router and layer settings Qwen3-MoE does not compute, and the flag named
    "sigmoid scores": ({"moe_router_score_function": "sigmoid"}, "--moe-router-score-function sigmoid:"),
    "top-k scaling": ({"moe_router_topk_scaling_factor": 2.5}, "--moe-router-topk-scaling-factor 2.5:"),
    "group-limited routing": ({"moe_router_num_groups": 2, "moe_router_group_topk": 1}, "--moe-router-num-groups 2:"),
    "capacity factor": ({"moe_expert_capacity_factor": 1.0}, "--moe-expert-capacity-factor 1.0:"),
    "shared expert": ({"moe_shared_expert_intermediate_size": 32}, "--moe-shared-expert-intermediate-size 32:"),
    "dense layers": ({"moe_layer_freq": [1, 0]}, "--moe-layer-freq [1, 0]:"),
    "no qk-norm": ({"qk_layernorm": False}, "--qk-layernorm:"),
    "biases": ({"add_bias_linear": True}, "--disable-bias-linear:"),
}


def test_lm_eval_on_the_moe_export_agrees_with_the_validation_loss(run, exported, small_corpus, text_files,
                                                                    tmp_path):
    lm_eval_agrees(run, exported, small_corpus, text_files, tmp_path)


def test_the_export_holds_no_earlier_group_when_it_reads_the_next(run, tmp_path):
    """The bytes of CPU tensors alive before each group (the embedding, a layer, the output) is
    read stay what they were before the first: no earlier group is held. Control: the same
    count with every group kept, as an export holding the model would, grows by each group."""
    counts = {}
    for hold in (False, True):
        result = tmp_path / f"live-{hold}.json"
        argv = [str(run["ckpt"]), str(tmp_path / f"hf-{hold}"), str(result), "--max-shard-size", SHARD]
        proc = warm_python("tests.support.export_live_bytes", argv + (["--hold"] if hold else []), TIMEOUT_S)
        assert proc.returncode == 0, proc.stdout[-4000:]
        counts[hold] = json.loads(result.read_text())
    streamed, held = counts[False], counts[True]
    assert len(streamed) == 4 and all(r["group_bytes"] > 60_000 for r in streamed)  # embedding, 2 layers, output
    assert max(r["live_before"] for r in streamed) - streamed[0]["live_before"] <= 4096, streamed
    grown = [r["live_before"] - held[0]["live_before"] for r in held]
    assert all(grown[i] >= sum(r["group_bytes"] for r in held[:i]) for i in range(len(held))), held


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_router_or_layer_qwen3_moe_does_not_compute_is_refused_naming_the_flag(run, tmp_path, monkeypatch, case):
    changes, expected = REFUSED[case]
    message = _refusal(run["ckpt"], tmp_path / "hf", monkeypatch, changes)
    assert message.startswith(expected), message
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("pre_softmax", [False, True])
def test_qwen3_moes_router_weighs_the_experts_megatrons_router_does(pre_softmax):
    """Megatron's softmax router (top k of the logits then softmax over them, or with
    --moe-router-pre-softmax softmax over all then top k) against Qwen3-MoE's router as
    configured by the export. Control: the other `norm_topk_prob` weighs them otherwise."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    from megatron_async.megatron_lm.export import hf_moe

    torch.manual_seed(0)
    hidden, experts, k = 16, 6, 3
    tokens = torch.randn(64, hidden, dtype=torch.float64)
    weight = torch.randn(experts, hidden, dtype=torch.float64)
    megatron, routed = topk_routing_with_score_function(tokens @ weight.t(), k, use_pre_softmax=pre_softmax)
    config = SimpleNamespace(num_query_groups=4, kv_channels=4, layernorm_epsilon=1e-5, add_qkv_bias=False,
                             num_moe_experts=experts, moe_router_topk=k, moe_ffn_hidden_size=8, ffn_hidden_size=8,
                             moe_router_pre_softmax=pre_softmax)
    args = SimpleNamespace(rotary_base=10000, moe_aux_loss_coeff=0.0)
    common = dict(vocab_size=32, num_hidden_layers=1, hidden_size=hidden, num_attention_heads=4)

    def weighed(hf_config):
        router = Qwen3MoeTopKRouter(hf_config).double()
        router.weight.data.copy_(weight)
        _, scores, indices = router(tokens)
        return torch.zeros(tokens.shape[0], experts, dtype=scores.dtype).scatter(1, indices, scores)

    exported = hf_moe.hf_config(args, config, common)
    assert torch.equal(weighed(exported) != 0, routed)
    assert torch.allclose(weighed(exported), megatron, rtol=0, atol=1e-6)  # both score in fp32
    exported.norm_topk_prob = not exported.norm_topk_prob
    assert (weighed(exported) - megatron).abs().max() > 1e-3


def test_multi_token_prediction_layers_are_left_out_saying_so(monkeypatch, capsys):
    from megatron_async.megatron_lm.export import cli, hf_architecture, hf_weights

    hf_architecture.refuse_unmapped(SimpleNamespace(mtp_num_layers=2))  # not refused
    weights = {"decoder.layers.0.x": torch.zeros(1), "mtp.layers.0.a": torch.zeros(1), "mtp.layers.1.b": torch.zeros(1)}
    assert hf_weights.mtp_dropped(weights) == 2
    done = {"mtp_dropped": 2, "directory": "d", "architecture": "Qwen3MoeForCausalLM", "out": "o", "tokenizer": False,
            "files": ["model.safetensors"]}
    monkeypatch.setattr(cli, "export", lambda *a, **k: done)
    cli.main(["--load", "d", "--out", "o"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and "left out the 2 multi-token-prediction layer(s) (--mtp-num-layers)" in lines[0], lines


def test_a_bf16_checkpoint_a_gpu_run_saves_exports_every_weight_as_saved(tmp_path):
    """The 10B example's layer at small width as a GPU run saves it: Megatron's arguments
    without the CPU flags (persistent layer norm and fused kernels asked for), bf16, so
    Megatron's Float16Module saved every weight in bf16, the norms' too. Written by
    bench/export/file_backed_checkpoint.py, where every weight chunk holds the first values of
    one file. Exported and loaded by transformers; each weight that is one chunk (embedding,
    output layer, norms, router, attention output, each expert's gate, up and down) is those
    values, bitwise, in bf16."""
    import transformers
    from safetensors import safe_open

    ckpt, out, pool = tmp_path / "ckpt", tmp_path / "hf", tmp_path / "pool"
    proc = warm_python("bench.export.file_backed_checkpoint", [
        str(ckpt), "--layers", "2", "--hidden", "256", "--experts", "4", "--moe-ffn", "64", "--vocab", "200",
        "--pool", str(pool)], TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-4000:]
    proc = export_cli(ckpt, out)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "as Qwen3MoeForCausalLM" in proc.stdout, proc.stdout[-2000:]
    values = torch.frombuffer(bytearray(pool.read_bytes()), dtype=torch.bfloat16)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        saved = {key: f.get_tensor(key) for key in f.keys()}
    assert {tensor.dtype for tensor in saved.values()} == {torch.bfloat16}
    whole = [key for key in saved if not key.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight"))]
    assert len(whole) == 2 + 1 + 2 * (6 + 3 * 4)
    assert [key for key in whole if not torch.equal(saved[key].flatten(), values[:saved[key].numel()])] == []
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16 and torch.equal(model.lm_head.weight, saved["lm_head.weight"])

"""Loss of exported Hugging Face models on the tokens of a run's validation, for the export tests.

    python -m tests.support.hf_validation_loss ITER_DIR OUT.json HF_DIR [HF_DIR ...] [--swap-kv-groups]
        [--permute-experts]

The tokens are those Megatron's evaluation after training read: the first `--eval-iters` x
`--global-batch-size` samples of the validation GPTDataset, rebuilt by Megatron's own dataset
builder from the arguments saved with the checkpoint (the same sample counts Megatron asked
for, the plugin's dataset config). Each model is loaded with `AutoModelForCausalLM` in fp32
and scored as Megatron's loss does: the mean over unmasked tokens of the cross entropy of
`labels`. `--swap-kv-groups` adds each model's loss with every Llama query head paired
with another key/value group (the groups' order reversed in k_proj and v_proj): the
mistake a mapping blind to Megatron's per-group layout would make (a control).
`--permute-experts` adds each MoE model's loss with every layer's experts rolled by one
place while its router's rows stay: the mistake of a mapping that gathers expert-parallel
ranks' experts in another order than their global numbers (a control).
"""

from __future__ import annotations

import argparse
import json

import torch


def validation_batch(directory: str) -> dict:
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset
    from megatron.training import global_vars
    from megatron.training.training import get_train_valid_test_num_samples

    from megatron_async.megatron_lm.adapter.gpt import dataset_config
    from megatron_async.megatron_lm.checkpoint.marker import saved_megatron_args

    args = saved_megatron_args(directory)
    global_vars.set_args(args)
    counts = get_train_valid_test_num_samples()
    _, valid, _ = BlendedMegatronDatasetBuilder(GPTDataset, counts, lambda: True, dataset_config(args)).build()
    samples = [valid[i] for i in range(args.eval_iters * args.global_batch_size)]
    return {key: torch.stack([torch.as_tensor(s[key]) for s in samples]) for key in ("tokens", "labels", "loss_mask")}


def _reverse_groups(weight: torch.Tensor, groups: int) -> torch.Tensor:
    return weight.reshape(groups, -1, *weight.shape[1:]).flip(0).reshape(weight.shape)


@torch.no_grad()
def loss(model_dir: str, batch: dict, swap_kv_groups: bool = False, permute_experts: bool = False) -> float:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if swap_kv_groups:
        groups = model.config.num_key_value_heads
        for layer in model.model.layers:
            for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.weight.copy_(_reverse_groups(proj.weight, groups))
    if permute_experts:
        for layer in model.model.layers:
            for weight in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                weight.copy_(weight.roll(1, dims=0))
    logits = model(input_ids=batch["tokens"].long()).logits.float()
    losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].long().flatten(), reduction="none")
    mask = batch["loss_mask"].float().flatten()
    return float((losses * mask).sum() / mask.sum())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("out")
    parser.add_argument("models", nargs="+")
    parser.add_argument("--swap-kv-groups", action="store_true")
    parser.add_argument("--permute-experts", action="store_true")
    options = parser.parse_args()
    batch = validation_batch(options.directory)
    result = {"tokens": int(batch["loss_mask"].sum()), "losses": [loss(m, batch) for m in options.models]}
    if options.swap_kv_groups:
        result["swapped_kv_groups"] = [loss(m, batch, swap_kv_groups=True) for m in options.models]
    if options.permute_experts:
        result["permuted_experts"] = [loss(m, batch, permute_experts=True) for m in options.models]
    with open(options.out, "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()

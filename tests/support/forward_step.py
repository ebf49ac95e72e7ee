"""The forward step Megatron's schedules call: batch -> GPT -> masked LM loss.

Loss follows Megatron-LM's three-value convention (sum of token losses, token
count, reporting tensor [sum, count]) so schedules normalise per microbatch and
logging can average exactly over tokens.
"""

from __future__ import annotations

from functools import partial
from typing import Iterator, Optional

import torch


def lm_loss(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.float().reshape(-1)
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach().clone(), mask.sum().detach()])
    return loss_sum, num_tokens, {"lm loss": report}


def unpack_batch(batch: dict) -> tuple:
    """(tokens, labels, loss_mask, position_ids, attention_mask) from a GPTDataset-style dict."""
    tokens = batch["tokens"]
    position_ids = batch.get("position_ids")
    if position_ids is None:
        position_ids = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    loss_mask = batch.get("loss_mask")
    if loss_mask is None:
        loss_mask = torch.ones_like(tokens, dtype=torch.float)
    return tokens, batch["labels"], loss_mask, position_ids, batch.get("attention_mask")


def gpt_forward_step(data_iterator: Optional[Iterator[dict]], model):
    """Megatron forward_step_func: every stage reads the batch so iterators stay in step."""
    batch = next(data_iterator)
    tokens, labels, loss_mask, position_ids, attention_mask = unpack_batch(batch)
    output = model(tokens, position_ids, attention_mask, labels=labels)
    return output, partial(lm_loss, loss_mask)


def reduce_lm_loss(losses_reduced: list[dict]) -> Optional[float]:
    """Token-averaged LM loss over this rank's microbatches (None off the last stage)."""
    if not losses_reduced:
        return None
    total = torch.stack([d["lm loss"] for d in losses_reduced]).sum(dim=0)
    return (total[0] / total[1].clamp(min=1)).item()

"""Global names of parameters: the same weight gets the same name in every layout.

Expert-parallel ranks hold different experts. Megatron's SequentialMLP numbers them
in the module path (`local_experts.<i>`), Transformer Engine's grouped GEMM in the
parameter name (`linear_fc1.weight<i>`); both must become the global expert index,
or every expert-parallel rank would draw the same experts.
"""

import pytest
import torch

from megatron_async.megatron_lm.adapter import layout_invariant_init


class _Layer(torch.nn.Module):
    def __init__(self, layer_number: int, grouped: bool, local_experts: int):
        super().__init__()
        self.layer_number = layer_number
        experts = torch.nn.Module()
        if grouped:
            experts.linear_fc1 = torch.nn.Module()
            for i in range(local_experts):
                experts.linear_fc1.register_parameter(f"weight{i}", torch.nn.Parameter(torch.zeros(2, 2)))
                experts.linear_fc1.register_parameter(f"bias{i}", torch.nn.Parameter(torch.zeros(2)))
        else:
            experts.local_experts = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(local_experts))
        self.mlp = torch.nn.Module()
        self.mlp.experts = experts


class _GPT(torch.nn.Module):
    def __init__(self, first_layer: int, grouped: bool, local_experts: int, num_experts: int):
        super().__init__()
        self.config = type("Config", (), {"num_moe_experts": num_experts})()
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList([_Layer(first_layer + 1, grouped, local_experts)])


def _names(monkeypatch, grouped: bool, ep_rank: int, ep_size: int, num_experts: int = 4) -> set[str]:
    from megatron.core import parallel_state

    monkeypatch.setattr(parallel_state, "get_expert_model_parallel_world_size", lambda: ep_size)
    monkeypatch.setattr(parallel_state, "get_expert_model_parallel_rank", lambda: ep_rank)
    model = _GPT(first_layer=3, grouped=grouped, local_experts=num_experts // ep_size, num_experts=num_experts)
    return set(layout_invariant_init.global_param_names(model).values())


@pytest.mark.parametrize("grouped", [False, True])
def test_expert_parallel_ranks_name_their_experts_globally(monkeypatch, grouped):
    whole = _names(monkeypatch, grouped, ep_rank=0, ep_size=1)
    split = [_names(monkeypatch, grouped, ep_rank=r, ep_size=2) for r in range(2)]
    assert not split[0] & split[1], "two expert-parallel ranks would draw the same expert"
    assert split[0] | split[1] == whole
    assert all(".layers.3." in name for name in whole)  # the global layer index


def test_grouped_expert_names_keep_their_kind():
    draw = layout_invariant_init.megatron_like(std=1.0, num_layers=8)
    gen = torch.Generator().manual_seed(0)
    assert not draw("decoder.layers.0.mlp.experts.linear_fc1.bias3", [4], gen).any()  # biases start at 0
    fc2 = draw("decoder.layers.0.mlp.experts.linear_fc2.weight3", [4096], gen).std()
    fc1 = draw("decoder.layers.0.mlp.experts.linear_fc1.weight3", [4096], gen).std()
    assert fc2 < fc1 / 3  # an output projection: std / sqrt(2 num_layers)

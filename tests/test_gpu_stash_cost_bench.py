"""bench.overhead.gpu_stash_cost's arithmetic and its refusal without CUDA (the GPU run itself is
in docs/benchmarks.md)."""

import argparse

import pytest

from bench.overhead import gpu_stash_cost


def test_ratio_and_extra_memory_come_from_the_runs():
    runs = {"plain": [{"s_per_iter": 1.0, "max_allocated_mib": 1000.0},
                      {"s_per_iter": 3.0, "max_allocated_mib": 1010.0}],
            "delay": [{"s_per_iter": 2.5, "max_allocated_mib": 1200.0},
                      {"s_per_iter": 2.5, "max_allocated_mib": 1190.0}]}
    out = gpu_stash_cost.summarise(runs, params_b=0.1)
    assert out["median_s_per_iter"] == {"plain": 2.0, "delay": 2.5}
    assert out["delay_over_plain"] == pytest.approx(1.25)
    assert out["extra_peak_mib"] == pytest.approx(190.0)
    assert out["extra_peak_over_bf16_weights"] == pytest.approx(190.0 / (0.1e9 * 2 / 2**20))
    assert "delay / plain: 1.250" in gpu_stash_cost.table({**out, "device": "x", "impl": "local"})


def test_only_the_delay_run_gets_the_stash(tmp_path):
    opts = argparse.Namespace(layers=2, hidden=64, heads=4, seq=32, micro_batch=1, global_batch=2, iters=3, impl="local")
    plain = gpu_stash_cost.run_flags(opts, "plain", tmp_path / "m")
    delay = gpu_stash_cost.run_flags(opts, "delay", tmp_path / "m")
    assert "--simulated-delay" not in plain and delay[delay.index("--simulated-delay") + 1] == 1
    assert "--no-gradient-accumulation-fusion" in plain  # the local layers on a node without apex


def test_refuses_without_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        gpu_stash_cost.main(["--iters", "2"])

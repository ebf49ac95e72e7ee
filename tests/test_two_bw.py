"""PipeDream-2BW on real Megatron models equals the one-step-delay algorithm.

Reference: the same model, data and initial weights at PP=1 with
`simulated_delay=1` (the gradient of batch b is taken at the weights of step
max(b-1, 0)). Layouts are initialised by parameter name so they start equal.
The references and twins several tests compare against run once (shared_run).
Tolerance: fp32 on CPU; a pipeline changes no reduction order inside a layer, so
the trajectories agree to float round-off (observed: bitwise); we allow 1e-6.
"""

import pytest
import torch

from tests.support.multiprocess import run_distributed, shared_run
from tests.support.tiny_gpt import TinyGPT, train_entry
from tests.support.trajectory import assert_same_trajectory

STEPS = 12
COMMON = dict(init_by_name=True, clip_grad=0.0, num_layers=4, global_batch_size=8, micro_batch_size=2)
RTOL = ATOL = 1e-6


def _reference(**overrides):
    (ref,) = shared_run(train_entry, 1, TinyGPT(simulated_delay=1, **{**COMMON, **overrides}), STEPS)
    return ref


@pytest.mark.parametrize("pp", [2, 4])
def test_2bw_equals_simulated_one_step_delay(pp):
    """With Megatron's default gradient-accumulation fusion: its local layers accumulate weight
    gradients straight into main_grad (the CPU emulation's kernel) and DDP skips their dummy
    gradients. Negative control: that kernel is what runs (overwriting changes the trajectory)."""
    ref = _reference()
    assert TinyGPT().gradient_accumulation_fusion
    results = shared_run(train_entry, pp, TinyGPT(pp=pp, schedule="2bw", **COMMON), STEPS)
    assert_same_trajectory(ref, results, RTOL, ATOL)
    if pp == 2:
        broken = run_distributed(_train_with_overwriting_wgrad_kernel, pp, TinyGPT(pp=pp, schedule="2bw", **COMMON),
                                 STEPS)
        with pytest.raises(AssertionError):
            assert_same_trajectory(ref, broken, RTOL, ATOL)


def test_2bw_stage_local_clipping_equals_reference_with_the_same_rule():
    clipped = {**COMMON, "clip_grad": 0.05}  # small enough that every step clips
    (ref,) = shared_run(train_entry, 1, TinyGPT(simulated_delay=1, clip_stages=2, **clipped), STEPS)
    results = shared_run(train_entry, 2, TinyGPT(pp=2, schedule="2bw", **clipped), STEPS)
    assert_same_trajectory(ref, results, RTOL, ATOL)
    # and the rule matters: one global norm gives another trajectory
    (global_ref,) = shared_run(train_entry, 1, TinyGPT(simulated_delay=1, **clipped), STEPS)
    with pytest.raises(AssertionError):
        assert_same_trajectory(global_ref, results, RTOL, ATOL)


def test_2bw_differs_from_synchronous_training():
    """The equivalence check can fail: 2BW is not the synchronous trajectory."""
    (sync,) = shared_run(train_entry, 1, TinyGPT(**COMMON), STEPS)
    results = shared_run(train_entry, 2, TinyGPT(pp=2, schedule="2bw", **COMMON), STEPS)
    with pytest.raises(AssertionError):
        assert_same_trajectory(sync, results, RTOL, ATOL)


# DP and TP change the order of floating-point reductions. Adam divides by sqrt(v),
# so for near-zero gradients (biases) round-off becomes a visible fraction of one
# update: weights are compared to 10% of one step (lr=1e-2), losses to 1e-5
# relative. A wrong weight version (no delay, or two steps) fails this tolerance (checked below).
LAYOUT = (1e-4, 1e-3, 1e-5)  # rtol, atol, loss rtol


def _assert_layout_tolerance_tells_versions_apart(results, **overrides):
    """Negative control at LAYOUT's tolerance: the same run against a reference at the wrong
    weight version (no delay, and a two-step delay) must fail the comparison."""
    for delay in (0, 2):
        (wrong,) = shared_run(train_entry, 1, TinyGPT(simulated_delay=delay, **{**COMMON, **overrides}), STEPS)
        with pytest.raises(AssertionError):
            assert_same_trajectory(wrong, results, *LAYOUT)


@pytest.mark.parametrize("overlap_grad_reduce", [False, True])
def test_2bw_with_data_parallel_distributed_optimizer(overlap_grad_reduce):
    ref = _reference(use_distributed_optimizer=True)
    spec = TinyGPT(pp=2, schedule="2bw", use_distributed_optimizer=True, overlap_grad_reduce=overlap_grad_reduce,
                   **COMMON)
    results = shared_run(train_entry, 4, spec, STEPS)
    assert_same_trajectory(ref, results, *LAYOUT)
    if not overlap_grad_reduce:
        _assert_layout_tolerance_tells_versions_apart(results, use_distributed_optimizer=True)


def test_2bw_with_tensor_parallel():
    ref = _reference()
    spec = TinyGPT(pp=2, tp=2, schedule="2bw", **COMMON)
    results = shared_run(train_entry, 4, spec, STEPS)
    assert_same_trajectory(ref, results, *LAYOUT)
    _assert_layout_tolerance_tells_versions_apart(results)


def test_two_weight_buffers_per_stage():
    results = shared_run(train_entry, 2, TinyGPT(pp=2, schedule="2bw", **COMMON), 3)
    for r in results:
        assert r["weight_buffers"] == 2
        # the overhead is exactly one extra copy of the stage's own parameters
        stage_bytes = sum(t.numel() * t.element_size() for t in r["params"].values())
        assert r["stash_bytes"] == r["live_bytes"] == stage_bytes


def test_stale_global_clipping_uses_previous_steps_global_norm():
    spec = TinyGPT(pp=2, schedule="2bw", clip_grad_mode="stale-global", **{**COMMON, "clip_grad": 0.05})
    results = shared_run(train_entry, 2, spec, 6)
    local = [r["norm_local"] for r in results]  # [stage][step][call]
    for r in results:
        used = r["norm_used"]
        assert used[0] == r["norm_local"][0]  # step 0: nothing older, clip stage-locally
        for step in range(1, 6):
            for call, value in enumerate(used[step]):
                expected = sum(stage[step - 1][call] ** 2 for stage in local) ** 0.5
                assert value == pytest.approx(expected, rel=1e-12)
    # stale-global clipping is a different trajectory from stage-local clipping
    stage_local = shared_run(train_entry, 2, TinyGPT(pp=2, schedule="2bw", **{**COMMON, "clip_grad": 0.05}), 6)
    assert results[1]["losses"] != stage_local[1]["losses"]


def test_2bw_with_expert_parallel_moe_and_stage_local_clipping():
    """PP=2 x EP=2 (4 experts, all-to-all), clipping every step: expert gradient norms
    sum over the stage's expert-parallel ranks, dense ones do not."""
    moe = {**COMMON, "clip_grad": 0.05, "num_experts": 4, "moe_token_dispatcher_type": "alltoall"}
    (ref,) = shared_run(train_entry, 1, TinyGPT(simulated_delay=1, clip_stages=2, **moe), STEPS)
    results = shared_run(train_entry, 4, TinyGPT(pp=2, ep=2, schedule="2bw", **moe), STEPS)
    assert_same_trajectory(ref, results, *LAYOUT)


@pytest.mark.parametrize("stop", [0, 3])
def test_an_early_stop_drains_the_pipeline_without_training_further(stop):
    """A run planned for 500 iterations stops after `stop + 1` (as with --exit-interval):
    every stage ends (the harness times out on a hang) having run no forward beyond the
    warm-up of the next batch, and holding no pending send."""
    spec = TinyGPT(pp=4, schedule="2bw", planned_iterations=500, **COMMON)
    results = shared_run(train_entry, 4, spec, stop + 1)
    m = spec.num_microbatches(4)
    for r in results:
        assert r["forwards"] <= (stop + 2) * m, (r["rank"], r["forwards"])


def _train_with_overwriting_wgrad_kernel(rank, world_size, spec, steps):
    """The ranks' fused weight-gradient kernel overwrites main_grad instead of adding."""
    import sys

    from megatron_async import cpu

    def overwrite(total_input, grad_output, main_grad):
        main_grad.zero_()
        cpu.wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)

    sys.modules[cpu.FUSED_WGRAD_MODULE].wgrad_gemm_accum_fp32 = overwrite
    return train_entry(rank, world_size, spec, steps)

"""`--delay-correction dc-asgd`, `predict` and `nesterov` (docs/delay_correction.md).

- DC-ASGD's rule on a torch optimizer whose updates are known in closed form (float64,
  1e-12); lambda_0 = 0 is bitwise the plain optimizer on Megatron (negative control:
  lambda_0 = 1 is not); 2bw at PP=2 with it equals its PP=1 one-step-delay twin
  (1e-6, as tests/test_two_bw.py);
- weight prediction: the stash holds P(v) = W(v) + alpha (W(v) - W(v-1)) for the
  versions microbatches use (checked against weights set by hand); alpha = 0 is
  bitwise plain one-step delay (negative control: alpha = 1 is not); 2bw at PP=2
  equals its PP=1 twin (1e-6); in Megatron's loop a 2bw run with prediction resumes
  bit for bit (tests/test_megatron_loop.py);
- Nesterov look-ahead: SGD with momentum beta, corrected with beta, is torch's
  SGD(nesterov=True) (float64, 1e-12; negative control: uncorrected is not); Adam's
  first moment becomes beta m_t + (1 - beta) g_t of the plain Adam fed the same
  gradients; beta = 0 is bitwise the plain optimizer (negative control: 0.9 is not);
  2bw at PP=2 equals its PP=1 twin (1e-6);
- both DC-ASGD and Nesterov under Adam's distributed optimizer and the layer-wise
  distributed Muon at DP=2 equal DP=1 (layout tolerances), and differ from DP=2
  without the correction (negative control: the correction acts on the shards).
"""

import pytest
import torch

from megatron_async.corrections.delay_correction import DC_BETA, DC_EPS, DelayCorrectedOptimizer
from tests.support.multiprocess import run_distributed
from tests.support.tiny_gpt import TinyGPT
from tests.support.trajectory import assert_same_trajectory
from test_delay_correction import _OneTorchOptimizer  # the same stand-in

STEPS = 8
COMMON = dict(init_by_name=True, clip_grad=0.0, num_layers=4, global_batch_size=8, micro_batch_size=2)


def dc_train_entry(rank, world_size, spec, iterations, dc_lambda, rule="dc-asgd"):
    """tiny_gpt.train with the optimizer wrapped in DC-ASGD (or, with rule="nesterov", the
    look-ahead with beta = dc_lambda); patched in this rank's process only."""
    from tests.support import tiny_gpt

    plain = tiny_gpt.get_megatron_optimizer
    if dc_lambda is not None:
        tiny_gpt.get_megatron_optimizer = lambda config, model: DelayCorrectedOptimizer(
            plain(config, model), rule=rule, dc_lambda=dc_lambda, nesterov_beta=dc_lambda)
    return tiny_gpt.train(spec, iterations, rank, world_size)


# --- DC-ASGD ---------------------------------------------------------------------------

def test_dc_asgd_rule_on_known_updates():
    """SGD (lr 0.1, no momentum) with gradients that do not depend on w: D_t = -0.1 g~_t and
    g~_t = g_t + lambda g_t^2 D_{t-1} / sqrt(ms_t), ms the mean square, by recurrence here."""
    grads = [torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(t)) for t in range(6)]
    lam = 0.7
    w = torch.nn.Parameter(torch.zeros(4, 3, dtype=torch.float64))
    opt = DelayCorrectedOptimizer(_OneTorchOptimizer(torch.optim.SGD([w], lr=0.1)), rule="dc-asgd", dc_lambda=lam)
    expected, prev, ms = torch.zeros(4, 3, dtype=torch.float64), None, None
    for g in grads:
        w.grad = g.clone()
        assert opt.step()[0]
        ms = g * g if ms is None else ms
        ms = DC_BETA * ms + (1 - DC_BETA) * g * g
        corrected = g if prev is None else g + lam * g * g * prev / (ms.sqrt() + DC_EPS)
        prev = -0.1 * corrected
        expected += prev
    torch.testing.assert_close(w.detach(), expected, rtol=1e-12, atol=1e-12)
    assert opt.delay_correction.buffer_bytes() == 2 * w.numel() * w.element_size()


def test_dc_asgd_lambda_zero_is_bitwise_the_plain_optimizer():
    spec = TinyGPT(simulated_delay=1, **COMMON)
    (plain,) = run_distributed(dc_train_entry, 1, spec, STEPS, None)
    (zero,) = run_distributed(dc_train_entry, 1, spec, STEPS, 0.0)
    assert_same_trajectory(plain, [zero], 0.0, 0.0, exact=True)
    (one,) = run_distributed(dc_train_entry, 1, spec, STEPS, 1.0)
    with pytest.raises(AssertionError):
        assert_same_trajectory(plain, [one], 1e-6, 1e-6)


def test_2bw_with_dc_asgd_equals_simulated_delay_with_dc_asgd():
    (ref,) = run_distributed(dc_train_entry, 1, TinyGPT(simulated_delay=1, **COMMON), STEPS, 1.0)
    results = run_distributed(dc_train_entry, 2, TinyGPT(pp=2, schedule="2bw", **COMMON), STEPS, 1.0)
    assert_same_trajectory(ref, results, 1e-6, 1e-6)


# --- weight prediction ---------------------------------------------------------------------

def prediction_rule_entry(rank, world_size, alpha):
    """Set the live weights by hand around two steps; return what the stash holds."""
    from megatron_async.stash.weight_stash import WeightStashManager
    from tests.support.tiny_gpt import build

    model, _, _ = build(TinyGPT(**COMMON))
    stash = WeightStashManager(model, depth=1, predict=alpha)
    first = stash.params[0]
    w0 = first.detach().clone()
    seen = {}
    for step, delta in ((0, 1.0), (1, 2.0)):
        with stash.optimizer_step():
            for p in stash.params:
                p.data.add_(delta)
        for version in stash.versions_held():
            stash.point_to(version)
            seen[(step, version)] = first.detach().clone() - w0
    stash.point_to(2)
    return {"seen": seen, "weight_buffers": stash.num_weight_buffers()}


def test_prediction_stash_holds_the_predicted_weights():
    (out,) = run_distributed(prediction_rule_entry, 1, 0.5)
    seen = {k: v.flatten()[0].item() for k, v in out["seen"].items()}
    # W0, W1 = W0 + 1, W2 = W0 + 3; P(v) = W(v) + 0.5 (W(v) - W(v-1)), P(0) = W0
    assert seen[(0, 0)] == pytest.approx(0.0) and seen[(0, 1)] == pytest.approx(1.5)
    assert seen[(1, 1)] == pytest.approx(1.5) and seen[(1, 2)] == pytest.approx(3.0 + 1.0)
    assert (1, 0) not in seen  # P(0) is no longer needed after step 1
    assert out["weight_buffers"] == 3  # live + two predictions


def test_prediction_alpha_zero_is_bitwise_plain_delay():
    plain = run_distributed(dc_train_entry, 1, TinyGPT(simulated_delay=1, **COMMON), STEPS, None)
    zero = run_distributed(dc_train_entry, 1, TinyGPT(simulated_delay=1, weight_prediction=0.0, **COMMON), STEPS, None)
    assert_same_trajectory(_merged(plain), zero, 0.0, 0.0, exact=True)
    one = run_distributed(dc_train_entry, 1, TinyGPT(simulated_delay=1, weight_prediction=1.0, **COMMON), STEPS, None)
    with pytest.raises(AssertionError):
        assert_same_trajectory(_merged(plain), one, 1e-6, 1e-6)


def test_2bw_with_prediction_equals_simulated_delay_with_prediction():
    spec = dict(weight_prediction=1.0, **COMMON)
    (ref,) = run_distributed(dc_train_entry, 1, TinyGPT(simulated_delay=1, **spec), STEPS, None)
    results = run_distributed(dc_train_entry, 2, TinyGPT(pp=2, schedule="2bw", **spec), STEPS, None)
    assert_same_trajectory(ref, results, 1e-6, 1e-6)


# --- Nesterov look-ahead -------------------------------------------------------------------

def _quadratic_grads(w: torch.Tensor, step: int) -> torch.Tensor:
    """A gradient that depends on the weights (so look-ahead changes the trajectory)."""
    target = torch.randn(w.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
    return (w.detach() - target) * torch.linspace(0.5, 2.0, w.numel(), dtype=torch.float64).view_as(w)


def _sgd_trajectory(corrected: bool, nesterov: bool, beta: float = 0.9, steps: int = 8) -> torch.Tensor:
    w = torch.nn.Parameter(torch.zeros(4, 3, dtype=torch.float64))
    opt = _OneTorchOptimizer(torch.optim.SGD([w], lr=0.1, momentum=beta, nesterov=nesterov))
    if corrected:
        opt = DelayCorrectedOptimizer(opt, rule="nesterov", nesterov_beta=beta)
    for t in range(steps):
        w.grad = _quadratic_grads(w, t)
        opt.step()
    return w.detach().clone()


def test_nesterov_correction_turns_sgd_momentum_into_torch_nesterov():
    torch_nesterov = _sgd_trajectory(corrected=False, nesterov=True)
    torch.testing.assert_close(_sgd_trajectory(corrected=True, nesterov=False), torch_nesterov, rtol=1e-12, atol=1e-12)
    with pytest.raises(AssertionError):  # negative control: heavy-ball momentum is not Nesterov
        torch.testing.assert_close(_sgd_trajectory(corrected=False, nesterov=False), torch_nesterov,
                                   rtol=1e-6, atol=1e-6)


def test_nesterov_correction_gives_adam_the_look_ahead_first_moment():
    """With gradients that do not depend on w, plain Adam's first moment m_t gives the
    corrected one in closed form: beta m_t + (1 - beta) g_t (g_{-1} = 0)."""
    beta = 0.9
    grads = [torch.randn(5, dtype=torch.float64, generator=torch.Generator().manual_seed(t)) for t in range(6)]
    plain_w = torch.nn.Parameter(torch.zeros(5, dtype=torch.float64))
    corr_w = torch.nn.Parameter(torch.zeros(5, dtype=torch.float64))
    plain = torch.optim.Adam([plain_w], lr=0.01, betas=(beta, 0.999))
    corrected = DelayCorrectedOptimizer(_OneTorchOptimizer(torch.optim.Adam([corr_w], lr=0.01, betas=(beta, 0.999))),
                                        rule="nesterov", nesterov_beta=beta)
    for g in grads:
        plain_w.grad, corr_w.grad = g.clone(), g.clone()
        plain.step()
        corrected.step()
        m_plain = plain.state[plain_w]["exp_avg"]
        m_corrected = corrected.wrapped.optimizer.state[corr_w]["exp_avg"]
        torch.testing.assert_close(m_corrected, beta * m_plain + (1 - beta) * g, rtol=1e-12, atol=1e-12)
    assert corrected.delay_correction.buffer_bytes() == corr_w.numel() * corr_w.element_size()


def test_nesterov_beta_zero_is_bitwise_the_plain_optimizer():
    spec = TinyGPT(simulated_delay=1, **COMMON)
    (plain,) = run_distributed(dc_train_entry, 1, spec, STEPS, None)
    (zero,) = run_distributed(dc_train_entry, 1, spec, STEPS, 0.0, "nesterov")
    assert_same_trajectory(plain, [zero], 0.0, 0.0, exact=True)
    (look_ahead,) = run_distributed(dc_train_entry, 1, spec, STEPS, 0.9, "nesterov")
    with pytest.raises(AssertionError):
        assert_same_trajectory(plain, [look_ahead], 1e-6, 1e-6)


def test_2bw_with_nesterov_equals_simulated_delay_with_nesterov():
    (ref,) = run_distributed(dc_train_entry, 1, TinyGPT(simulated_delay=1, **COMMON), STEPS, 0.9, "nesterov")
    results = run_distributed(dc_train_entry, 2, TinyGPT(pp=2, schedule="2bw", **COMMON), STEPS, 0.9, "nesterov")
    assert_same_trajectory(ref, results, 1e-6, 1e-6)


def _merged(results: list[dict]) -> dict:
    """One reference out of the ranks of a pipeline: the last stage's losses, every weight."""
    losses = [r["losses"] for r in results if r["losses"][0] is not None][0]
    params = {name: value for r in results for name, value in r["params"].items()}
    return {"losses": losses, "params": params}


# --- under Megatron's distributed optimizers -------------------------------------------

# Both rules are elementwise in the main parameters and their gradients, so each DP rank
# corrects its own shard (Adam's distributed optimizer) or its own whole parameters (the
# layer-wise distributed Muon) with no communication: DP=2 equals DP=1 to the layout
# tolerances of tests/test_delay_correction.py (10% of one optimizer step).
MUON_LAYER_WISE = dict(optimizer="muon", lr=2e-2, extra_optimizer_config=dict(
    muon_fp32_matmul_prec="highest", use_layer_wise_distributed_optimizer=True, bf16=True))
DISTRIBUTED = {"adam distributed optimizer": (dict(use_distributed_optimizer=True), 1e-3),
               "layer-wise distributed muon": (MUON_LAYER_WISE, 2e-3)}


@pytest.mark.parametrize("layout", sorted(DISTRIBUTED))
@pytest.mark.parametrize("rule,strength", [("dc-asgd", 1.0), ("nesterov", 0.9)])
def test_correction_acts_on_the_distributed_optimizer_shards(layout, rule, strength):
    from test_delay_correction import LAYOUT_LOSS_RTOL, LAYOUT_RTOL

    extra, atol = DISTRIBUTED[layout]
    spec = TinyGPT(simulated_delay=1, **COMMON, **extra)
    (ref,) = run_distributed(dc_train_entry, 1, spec, STEPS, strength, rule)
    sharded = run_distributed(dc_train_entry, 2, spec, STEPS, strength, rule)
    assert_same_trajectory(ref, sharded, LAYOUT_RTOL, atol, LAYOUT_LOSS_RTOL)
    # negative control: the correction changes the sharded trajectory (it is not skipped)
    plain = run_distributed(dc_train_entry, 2, spec, STEPS, None)
    with pytest.raises(AssertionError):
        assert_same_trajectory(ref, plain, LAYOUT_RTOL, atol, LAYOUT_LOSS_RTOL)

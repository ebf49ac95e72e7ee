"""`--delay-correction ef`: U_t = D_t + lambda (D_t - D_{t-1}) around any Megatron optimizer.

- the rule itself, on a torch optimizer whose updates are known in closed form (1e-12,
  float64), and its state round trip;
- lambda = 0 is bitwise the plain optimizer (Adam, Muon; the fp32 distributed
  optimizer at DP=2; the bf16 distributed optimizer in the trainer);
- 2bw at PP=2 with EF equals the PP=1 one-step-delay reference with EF (1e-6, as in
  tests/test_two_bw.py: the correction is per stage and needs no communication);
- DP=2 with the distributed optimizer, and with the layer-wise distributed Muon,
  equals DP=1 (the buffer is sharded like the main parameters), to the layout
  tolerances of tests/test_two_bw.py (weights to 10% of one Adam step);
- the EF state is saved with the optimizer in Megatron's checkpoint and a run
  resumed in Megatron's loop equals the uninterrupted one (lm_loss of 4..6, 1e-6).
"""

import json

import pytest
import torch

from megatron_async.corrections.delay_correction import DelayCorrection, DelayCorrectedOptimizer, torch_optimizers
from tests.support.launch import torchrun_megatron
from tests.support.multiprocess import run_distributed, shared_run
from tests.support.tiny_gpt import TinyGPT
from tests.support.trajectory import assert_same_trajectory
from tests.support.warm_launch import warm_run

STEPS = 8
COMMON = dict(init_by_name=True, clip_grad=0.0, num_layers=4, global_batch_size=8, micro_batch_size=2)
MUON = dict(optimizer="muon", lr=2e-2, extra_optimizer_config=dict(muon_fp32_matmul_prec="highest"))
LAYOUT_RTOL, LAYOUT_ATOL, LAYOUT_LOSS_RTOL = 1e-4, 1e-3, 1e-5


def ef_train_entry(rank, world_size, spec, iterations, ef_lambda):
    """tiny_gpt.train with the optimizer wrapped in EF (patched in this rank's process only)."""
    from tests.support import tiny_gpt

    plain = tiny_gpt.get_megatron_optimizer
    if ef_lambda is not None:
        tiny_gpt.get_megatron_optimizer = lambda config, model: DelayCorrectedOptimizer(plain(config, model), ef_lambda)
    return tiny_gpt.train(spec, iterations, rank, world_size)


def _run(world, spec, ef_lambda, steps=STEPS):
    return shared_run(ef_train_entry, world, spec, steps, ef_lambda)


# --- the rule, without Megatron ----------------------------------------------------

class _OneTorchOptimizer:
    """The shape of a Megatron optimizer that matters to EF: `.optimizer` and `step()`."""

    def __init__(self, opt):
        self.optimizer = opt

    def step(self):
        self.optimizer.step()
        return True, None, None

    def load_state_dict(self, state):
        self.optimizer.load_state_dict(state)


def _sgd_run(grads, ef_lambda, stop=None, state=None):
    w = torch.nn.Parameter(torch.zeros(3, 2, dtype=torch.float64))
    opt = DelayCorrectedOptimizer(_OneTorchOptimizer(torch.optim.SGD([w], lr=0.1, momentum=0.9)), ef_lambda)
    if state is not None:
        w.data.copy_(state["w"])
        opt.optimizer.load_state_dict(state["sgd"])
        opt.delay_correction.load_state_dict(state["ef"])
    start = 0 if state is None else state["t"]
    for t in range(start, stop or len(grads)):
        w.grad = grads[t].clone()
        assert opt.step()[0]
    snapshot = {"w": w.detach().clone(), "sgd": opt.optimizer.state_dict(),
                "ef": opt.delay_correction.state_dict(), "t": stop or len(grads)}
    return w.detach(), snapshot


def test_ef_rule_on_known_updates():
    """With gradients that do not depend on w, SGD-momentum's updates D_t are known, and the
    EF sum telescopes: W_T = W_0 + sum(D_t) + lambda (D_{T-1} - D_0)."""
    grads = [torch.randn(3, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(t)) for t in range(6)]
    buf, updates = torch.zeros(3, 2, dtype=torch.float64), []
    for g in grads:
        buf = 0.9 * buf + g
        updates.append(-0.1 * buf)
    for lam in (0.0, 0.5, 1.0):
        w, _ = _sgd_run(grads, lam)
        expected = sum(updates) + lam * (updates[-1] - updates[0])
        torch.testing.assert_close(w, expected, rtol=1e-12, atol=1e-12)


def test_ef_state_dict_resume_equals_uninterrupted():
    grads = [torch.randn(3, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(t)) for t in range(6)]
    full, _ = _sgd_run(grads, 1.0)
    _, at3 = _sgd_run(grads, 1.0, stop=3)
    resumed, _ = _sgd_run(grads, 1.0, state=at3)
    assert torch.equal(resumed, full)
    # the saved previous update matters: dropping it changes the result
    at3["ef"] = {**at3["ef"], "prev": [None]}
    dropped, _ = _sgd_run(grads, 1.0, state=at3)
    assert not torch.equal(dropped, full)


def test_ef_only_corrects_the_wrapped_step():
    """Inner steps outside `step()` (e.g. Megatron's dummy state-initialising step) are untouched."""
    w = torch.nn.Parameter(torch.zeros(2))
    inner = _OneTorchOptimizer(torch.optim.SGD([w], lr=1.0))
    correction = DelayCorrection(inner, 1.0)
    w.grad = torch.ones(2)
    inner.step()
    assert correction.steps == 0 and correction.buffer_bytes() == 0
    with correction.enabled():
        inner.step()
    assert correction.steps == 1 and correction.buffer_bytes() == w.numel() * w.element_size()


def test_finds_every_torch_optimizer_in_a_chain():
    a = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    b = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])

    class Chain:
        chained_optimizers = [_OneTorchOptimizer(a), type("C", (), {"chained_optimizers": [_OneTorchOptimizer(b)]})()]

    assert torch_optimizers(Chain()) == [a, b]


# --- on Megatron, multi-rank -------------------------------------------------------

@pytest.mark.parametrize("opt", ["adam", "muon"])
def test_lambda_zero_is_bitwise_the_plain_optimizer(opt):
    spec = TinyGPT(simulated_delay=1, **COMMON, **(MUON if opt == "muon" else {}))
    (plain,) = _run(1, spec, None)
    (zero,) = _run(1, spec, 0.0)
    assert_same_trajectory(plain, [zero], 0.0, 0.0, exact=True)
    (one,) = _run(1, spec, 1.0)
    with pytest.raises(AssertionError):
        assert_same_trajectory(plain, [one], 1e-6, 1e-6)


def test_lambda_zero_is_bitwise_with_the_distributed_optimizer():
    spec = TinyGPT(simulated_delay=1, use_distributed_optimizer=True, **COMMON)
    plain = _run(2, spec, None)
    zero = _run(2, spec, 0.0)
    assert_same_trajectory(plain[0], zero, 0.0, 0.0, exact=True)


@pytest.mark.parametrize("opt", ["adam", "muon"])
def test_2bw_with_ef_equals_simulated_delay_with_ef(opt):
    extra = MUON if opt == "muon" else {}
    (ref,) = _run(1, TinyGPT(simulated_delay=1, **COMMON, **extra), 1.0)
    results = _run(2, TinyGPT(pp=2, schedule="2bw", **COMMON, **extra), 1.0)
    assert_same_trajectory(ref, results, 1e-6, 1e-6)


def test_ef_with_data_parallel_distributed_optimizer():
    (ref,) = _run(1, TinyGPT(simulated_delay=1, use_distributed_optimizer=True, **COMMON), 1.0)
    results = _run(2, TinyGPT(simulated_delay=1, use_distributed_optimizer=True, **COMMON), 1.0)
    assert_same_trajectory(ref, results, LAYOUT_RTOL, LAYOUT_ATOL, LAYOUT_LOSS_RTOL)
    # negative control: at this tolerance, DP=2 without EF is told apart from the EF reference
    without = _run(2, TinyGPT(simulated_delay=1, use_distributed_optimizer=True, **COMMON), None)
    with pytest.raises(AssertionError):
        assert_same_trajectory(ref, without, LAYOUT_RTOL, LAYOUT_ATOL, LAYOUT_LOSS_RTOL)


def test_ef_with_layer_wise_distributed_muon():
    """Layer-wise: each DP rank steps whole parameters of its own; EF keeps their D only."""
    from test_muon import LAYER_WISE

    lw = dict(MUON, extra_optimizer_config=dict(MUON["extra_optimizer_config"], **LAYER_WISE))
    (ref,) = _run(1, TinyGPT(simulated_delay=1, **COMMON, **lw), 1.0)
    results = run_distributed(ef_train_entry, 2, TinyGPT(simulated_delay=1, **COMMON, **lw), STEPS, 1.0)
    assert_same_trajectory(ref, results, LAYOUT_RTOL, 2e-3, LAYOUT_LOSS_RTOL)  # atol: 10% of one Adam step at lr 2e-2


# --- in Megatron's training loop ------------------------------------------------------

TRAINER = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "500", "--num-layers", "2",
           "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
           "--max-position-embeddings", "32", "--lr", "1e-3", "--micro-batch-size", "2", "--global-batch-size", "8",
           "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0", "--rerun-mode", "disabled",
           "--log-interval", "1", "--eval-interval", "100", "--eval-iters", "1", "--simulated-delay", "1"]
MUON_EF = ["--train-iters", "6", "--optimizer", "muon", "--delay-correction", "ef"]


def _losses(path):
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    return {r["iteration"]: r["lm_loss"] for r in records if "lm_loss" in r}


def test_trainer_resume_restores_ef_state(tmp_path):
    full, resumed, ckpt = tmp_path / "full.jsonl", tmp_path / "resumed.jsonl", tmp_path / "ckpt"
    run = torchrun_megatron(TRAINER + MUON_EF + ["--save", ckpt, "--save-interval", "3", "--metrics-json", full],
                            nproc=1, timeout_s=200)
    assert run.returncode == 0, run.stdout[-4000:]
    # the previous update is saved with the optimizer, one record per rank
    assert b"delay_correction/shard_" in (ckpt / "iter_0000003" / ".metadata").read_bytes()
    (ckpt / "latest_checkpointed_iteration.txt").write_text("3")
    run = torchrun_megatron(TRAINER + MUON_EF + ["--load", ckpt, "--metrics-json", resumed], nproc=1, timeout_s=200)
    assert run.returncode == 0, run.stdout[-4000:]
    assert "at iteration 3" in run.stdout  # Megatron's "successfully loaded checkpoint ... at iteration 3"
    a, b = _losses(full), _losses(resumed)
    assert sorted(b) == [4, 5, 6]
    for it in (4, 5, 6):
        assert b[it] == pytest.approx(a[it], rel=1e-6, abs=0), it
    # negative control: without its marker the checkpoint resumes with no stash and no EF state
    # (as it did before such a resume was refused: the refusal switched off)
    (ckpt / "iter_0000003" / "megatron_async.json").unlink()
    bare = tmp_path / "bare.jsonl"
    run = warm_run("tests.support.step_end_entry",
                   ["--gpt", *map(str, TRAINER + MUON_EF + ["--load", ckpt, "--metrics-json", bare])], 1, 200,
                   env={"MEGATRON_ASYNC_TEST_OLD_MARKERLESS_RESUME": "1"})
    assert run.returncode == 0, run.stdout[-4000:]
    c = _losses(bare)
    assert any(c[it] != pytest.approx(a[it], rel=1e-6, abs=0) for it in (4, 5, 6)), (c, a)


def test_trainer_lambda_zero_is_plain_with_bf16_distributed_optimizer(tmp_path):
    """bf16: the correction lands on the fp32 main shards, then Megatron's copy to the bf16
    model params and its all-gather carry it; with lambda = 0 the run is the plain run."""
    base = TRAINER + ["--train-iters", "4", "--bf16", "--use-distributed-optimizer"]
    runs = {}
    for name, extra in (("plain", []), ("zero", ["--delay-correction", "ef", "--ef-lambda", "0"]),
                        ("one", ["--delay-correction", "ef", "--ef-lambda", "1"])):
        path = tmp_path / f"{name}.jsonl"
        run = torchrun_megatron(base + ["--metrics-json", path] + extra, nproc=2, timeout_s=200)
        assert run.returncode == 0, run.stdout[-4000:]
        with open(path, encoding="utf-8") as f:
            runs[name] = [{k: v for k, v in json.loads(line).items() if k not in ("s_per_iter", "tokens_per_s")}
                          for line in f]
    assert runs["plain"] == runs["zero"]
    # negative control: the correction does reach the bf16 model (lambda 1 trains another trajectory)
    assert [r.get("lm_loss") for r in runs["one"]] != [r.get("lm_loss") for r in runs["plain"]]


def test_ef_sanity_on_the_tiny_model():
    """Not a benchmark (one seed, 60 steps): on TinyGPT with Adam, EF recovers most of what the
    one-step delay loses (mean loss of the last 10 steps: synchronous 1.43, delayed 2.26, EF 1.51)."""
    spec = dict(COMMON, num_layers=2, clip_grad=1.0)
    mean_tail = lambda r: sum(r["losses"][-10:]) / 10  # noqa: E731
    (delayed,) = _run(1, TinyGPT(simulated_delay=1, **spec), None, steps=60)
    (corrected,) = _run(1, TinyGPT(simulated_delay=1, **spec), 1.0, steps=60)
    assert mean_tail(corrected) < mean_tail(delayed) - 0.3, (mean_tail(corrected), mean_tail(delayed))

"""2bw's interleaving through real Transformer Engine modules (1 GPU, TE; fp8 cases need fp8).

Microbatch A's forward at version v, the optimizer step, the next batch's first
forward at v+1, then A's backward at v (tests/support/gpu/te_interleave.py
plays it on TENorm, TELayerNormColumnParallelLinear, TELinear and
TEColumnParallelGroupedLinear in Megatron's DDP, with gradient-accumulation fusion
into `main_grad`). A's input gradient and weight gradients are compared with an
explicit-weights reference: the same modules loaded with v's weights, run without
interleaving, with the fp8 scales the interleaved run used.

Tolerances (relative Frobenius error, the largest over tensors): BF16_RTOL is a
few bf16 units in the last place (2^-8 = 3.9e-3); FP8_RTOL is half a unit of
e4m3's 3-bit mantissa (2^-4). Both runs call the same kernels on the same inputs,
so the errors are expected far below either.

Negative controls, with the same metric: against the second microbatch's
gradient alone (as if the fused accumulation overwrote `main_grad`), against A's
gradients at v+1 (as if the backward read the newest weights), and in fp8 with
the caches left on, where A's backward reads the fp8 weights the next batch
refreshed.
"""

import json

import pytest

from tests.support.gpu.launch import run_module, tail

BF16_RTOL = 1e-2
FP8_RTOL = 6.25e-2
TIMEOUT_S = 600
MATCHED = ("A0.input", "A1.input", "A0.main_grad", "batch.main_grad")
CONTROLS = ("accumulation_control", "version_control")
pytestmark = pytest.mark.timeout(TIMEOUT_S + 120)  # one subprocess each, killed at TIMEOUT_S


def _interleave(case: str, tmp_path) -> dict:
    out = tmp_path / f"{case}.json"
    proc = run_module("tests.support.gpu.te_interleave", [case, out], TIMEOUT_S)
    assert proc.returncode == 0, tail(proc)
    return json.loads(out.read_text())


def _assert_matches_reference(result: dict, rtol: float) -> None:
    errors = result["errors"]
    assert result["finite"], "non-finite gradients"
    assert result["switched_modules"] >= 3, "every TE linear wrapper must have had its cache switched off"
    worst = {k: errors[k] for k in MATCHED if errors[k] > rtol}
    assert not worst, f"interleaved gradients differ from the explicit-weights reference beyond {rtol}: {worst}"
    blind = {k: errors[k] for k in CONTROLS if errors[k] <= rtol}
    assert not blind, f"the comparison cannot tell a broken run at tolerance {rtol}: {blind}"


@pytest.mark.te
def test_bf16_interleaving_matches_explicit_weights(tmp_path, gpu_record):
    result = _interleave("bf16", tmp_path)
    gpu_record(tolerance=BF16_RTOL, **result["errors"], per_param=result["per_param"])
    _assert_matches_reference(result, BF16_RTOL)


@pytest.mark.te
@pytest.mark.fp8
def test_fp8_interleaving_with_caches_disabled_matches_explicit_weights(tmp_path, gpu_record):
    result = _interleave("fp8", tmp_path)
    gpu_record(tolerance=FP8_RTOL, **result["errors"], per_param=result["per_param"])
    _assert_matches_reference(result, FP8_RTOL)


@pytest.mark.te
@pytest.mark.fp8
def test_fp8_with_caches_on_the_backward_reads_the_refreshed_weights(tmp_path, gpu_record):
    """Negative control for the switch: without disable_first_microbatch_caches the next
    batch's first forward refreshes TE's cached fp8 weights to v+1 in place, and A's
    input gradient (computed from that cache) leaves the reference by more than FP8_RTOL."""
    result = _interleave("fp8-cached", tmp_path)
    gpu_record(tolerance=FP8_RTOL, **result["errors"])
    assert result["switched_modules"] == 0
    assert result["errors"]["A0.input"] > FP8_RTOL, result["errors"]

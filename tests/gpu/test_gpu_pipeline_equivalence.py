"""2bw at PP=2 equals its PP=1 twin on GPUs, with TE and EP=2 on an MoE (4 GPUs, TE).

The 2bw run is PP=2 x EP=2 (4 GPUs, data-parallel 2); its twin is PP=1 with
`--simulated-delay 1 --simulated-pipeline-stages 2` at EP=2 (2 GPUs, data-parallel
2), so the two differ only in the pipeline; `--layout-invariant-init` starts both
from the same weights. Four experts, top-2, TE's grouped GEMM, the aux loss on;
bf16. All runs use deterministic NCCL and TE kernels.

Tolerance: the largest relative loss difference over the iterations, LOSS_RTOL
(bf16 round-off reaching the loss through different reduction orders of the
stage-local gradient norms, amplified over a dozen steps). Negative control: the
same number against Megatron's synchronous 1F1B at PP=2 x EP=2 exceeds it.
"""

import pytest

from tests.support.gpu.compare import finite_losses, max_relative_difference
from tests.support.gpu.gpt_flags import MOE, gpt_flags, simulated_twin, two_bw
from tests.support.gpu.launch import DETERMINISTIC_ENV, read_metrics, tail, torchrun_gpt, train_losses

ITERS = 12
LOSS_RTOL = 5e-3
TIMEOUT_S = 600
BASE = gpt_flags(iters=ITERS, lr=5e-3, micro_batch=2, global_batch=16) + MOE + ["--layout-invariant-init"]


def _losses(tmp_path, name: str, nproc: int, extra: list) -> list[float]:
    metrics = tmp_path / f"{name}.jsonl"
    proc = torchrun_gpt(BASE + extra + ["--metrics-json", metrics], nproc, TIMEOUT_S, env=DETERMINISTIC_ENV)
    assert proc.returncode == 0, f"{name}:\n{tail(proc)}"
    return finite_losses(train_losses(read_metrics(metrics)), ITERS)


@pytest.mark.te
@pytest.mark.gpus(4)
@pytest.mark.timeout(3 * TIMEOUT_S + 120)
def test_2bw_pp2_ep2_equals_its_simulated_twin(tmp_path, gpu_record):
    twin = _losses(tmp_path, "twin", 2, simulated_twin(2))
    pipelined = _losses(tmp_path, "2bw", 4, two_bw(2))
    sync = _losses(tmp_path, "1f1b", 4, ["--pipeline-model-parallel-size", 2])
    difference = max_relative_difference(pipelined, twin)
    control = max_relative_difference(pipelined, sync)
    gpu_record(tolerance=LOSS_RTOL, max_rel_difference=difference, control_vs_1f1b=control,
               twin=twin, two_bw=pipelined, one_f_one_b=sync)
    assert difference <= LOSS_RTOL, f"2bw differs from its twin by {difference:.2e}: {pipelined} vs {twin}"
    assert control > LOSS_RTOL, f"synchronous 1F1B is within {LOSS_RTOL} of 2bw ({control:.2e}): no power"

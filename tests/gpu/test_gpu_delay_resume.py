"""A torch_dist resume of a delayed Muon + EF run equals the uninterrupted run (1 GPU).

`--simulated-delay 1` keeps the same weight stash as 2bw on one rank, and
`--delay-correction ef` keeps the previous update; both travel in the optimizer's
sharded state dict. On one GPU, in bf16 with NCCL and dropout 0.1: saved at
iteration 4 (exiting there), resumed to 8; the interrupted run's losses equal the
uninterrupted run's within RESUME_RTOL (largest relative difference over
iterations, deterministic kernels). Negative control: the same checkpoint without
its marker file (megatron_async.json) resumes without the stash and the EF state,
so batch 5 runs at W4 instead of W3, and the same number exceeds RESUME_RTOL.
This is the one-GPU form of test_gpu_resume.py, which needs 2 GPUs and TE.
"""

import pytest

from tests.support.gpu.gpt_flags import MUON, gpt_flags
from tests.support.gpu.resume import resume_against_uninterrupted

ITERS, SAVED_AT = 8, 4
RESUME_RTOL = 5e-3
TIMEOUT_S = 600


@pytest.mark.parametrize("impl", [pytest.param("transformer_engine", marks=pytest.mark.te), "local"])
@pytest.mark.timeout(4 * TIMEOUT_S + 120)
def test_delayed_muon_ef_resume_equals_the_uninterrupted_run(impl, tmp_path, gpu_record):
    base = gpt_flags(iters=ITERS, lr=5e-3, micro_batch=2, global_batch=16, dropout=0.1, impl=impl) + MUON + [
        "--simulated-delay", 1, "--delay-correction", "ef", "--ckpt-format", "torch_dist"]
    r = resume_against_uninterrupted(tmp_path, base, 1, ITERS, SAVED_AT, TIMEOUT_S)
    difference, control = r["max_rel_difference"], r["control_without_marker"]
    gpu_record(impl=impl, tolerance=RESUME_RTOL, max_rel_difference=difference, control_without_marker=control,
               full=r["full"], resumed=r["resumed"], resumed_without_marker=r["without_marker"])
    assert difference <= RESUME_RTOL, f"resumed {r['resumed']} vs uninterrupted {r['full']}: {difference:.2e}"
    assert control > RESUME_RTOL, f"resuming without the stash stays within {RESUME_RTOL} ({control:.2e}): no power"

"""A torch_dist checkpoint resume under 2bw equals the uninterrupted run (2 GPUs, TE).

2bw at PP=2 with dropout 0.1, Transformer Engine in bf16: saved at iteration 4
(exiting there), resumed to 8; the losses of the interrupted run equal those of
the uninterrupted one within RESUME_RTOL (the largest relative difference over
iterations; both runs use deterministic NCCL and TE kernels, so only
non-reproducible kernels could move it). Negative control: the same checkpoint
without its marker file (megatron_async.json) resumes without the weight stash,
so batch 5 runs at W4 instead of W3 and the same number exceeds RESUME_RTOL.
"""

import pytest

from tests.support.gpu.gpt_flags import gpt_flags, two_bw
from tests.support.gpu.resume import resume_against_uninterrupted

ITERS, SAVED_AT = 8, 4
RESUME_RTOL = 5e-3
TIMEOUT_S = 600
BASE = gpt_flags(iters=ITERS, lr=5e-3, micro_batch=2, global_batch=16, dropout=0.1) + two_bw(2) + [
    "--ckpt-format", "torch_dist"]


@pytest.mark.te
@pytest.mark.gpus(2)
@pytest.mark.timeout(4 * TIMEOUT_S + 120)
def test_torch_dist_resume_under_2bw_equals_the_uninterrupted_run(tmp_path, gpu_record):
    r = resume_against_uninterrupted(tmp_path, BASE, 2, ITERS, SAVED_AT, TIMEOUT_S)
    difference, control = r["max_rel_difference"], r["control_without_marker"]
    gpu_record(tolerance=RESUME_RTOL, max_rel_difference=difference, control_without_stash=control,
               full=r["full"], resumed=r["resumed"], resumed_without_stash=r["without_marker"])
    assert difference <= RESUME_RTOL, f"resumed {r['resumed']} vs uninterrupted {r['full']}: {difference:.2e}"
    assert control > RESUME_RTOL, f"resuming without the stash stays within {RESUME_RTOL} ({control:.2e}): no power"

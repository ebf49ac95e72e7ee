"""The MoE auxiliary loss weighs the same under 2bw as under Megatron's 1F1B, in Megatron's loop.

Megatron's 1F1B scales the auxiliary loss by 1/m per microbatch; so must 2bw. After one step
both schedules took their first gradient at the initial weights (the delay acts from step 2),
so the validation loss after it must agree (1e-6 relative, fp32 on the CPU). Negative control:
2bw with the coefficient m times larger (what a missing scale would do, m = 4 here) gives
another loss. (2bw with MoE against its `--simulated-delay 1` twin: tests/test_twin_matrix_across_ranks.py.)
"""

from tests.support.loop_runs import RTOL, records, run
from tests.support.twins import MOE, two_bw_flags


def _first_step_val_loss(tmp_path, name, flags):
    proc, metrics = run(tmp_path, name, 2, flags + ["--train-iters", "1", "--eval-interval", "1"])
    assert proc.returncode == 0, proc.stdout[-5000:]
    (val,) = [r["val_loss"] for r in records(metrics) if "val_loss" in r]
    return val


def test_moe_aux_loss_weighs_the_same_under_2bw_and_1f1b(tmp_path):
    pp2 = ["--pipeline-model-parallel-size", "2"]  # clipping off: 1F1B clips by the global norm, 2bw per stage
    flags = MOE + ["--lr", "2e-2", "--clip-grad", "0"]
    one_f_one_b = _first_step_val_loss(tmp_path, "1f1b", flags + pp2)
    two_bw = _first_step_val_loss(tmp_path, "2bw", flags + two_bw_flags(2))
    assert abs(two_bw - one_f_one_b) <= RTOL * abs(one_f_one_b), (two_bw, one_f_one_b)
    heavier = [a if a != "0.01" else "0.04" for a in flags]
    unscaled = _first_step_val_loss(tmp_path, "unscaled", heavier + two_bw_flags(2))
    assert abs(unscaled - one_f_one_b) > RTOL * abs(one_f_one_b), (unscaled, one_f_one_b)

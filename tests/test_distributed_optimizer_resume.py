"""A 2bw checkpoint of Megatron's distributed optimizer resumes, at its DP size and at another.

PP=2 x DP=2 with `--use-distributed-optimizer` (and both overlaps) trains 8 iterations and saves a torch_dist
checkpoint at iteration 4 on the way (one run: the uninterrupted reference and the
checkpoint). Resumed from iteration 4 at DP=2 it equals the reference to the last bit
(allowed 1e-6 relative); resharded to DP=1 (the optimizer's shards gathered into one) it
equals it to round-off (another reduction order over the data-parallel ranks, 1e-5).
Negative control: the DP=1 resume without the optimizer's state (`--no-load-optim`,
fresh Adam moments) is further than that. On the CPU this needs the emulation's fixes
to Megatron's distributed optimizer (megatron_async/cpu.py).
"""

from test_checkpoint_formats import RESHARD_RTOL, _close
from tests.support.loop_runs import ITERS, assert_same, logged_losses, losses, run

SAVED_AT = 4
PP2_2BW = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw"]
# with the overlapped reduce and parameter gather public recipes set: the save comes between a
# step and the gathers of its update, which Megatron's save finishes (force_param_sync)
DIST_OPT = ["--ckpt-format", "torch_dist", "--use-distributed-optimizer", "--overlap-grad-reduce",
            "--overlap-param-gather", *PP2_2BW]


def _resumed(tmp_path, name, nproc, ckpt, extra=()):
    """Losses of iterations 1..ITERS: the reference's up to SAVED_AT, then this resume's."""
    proc, metrics = run(tmp_path, name, nproc, DIST_OPT + ["--load", str(ckpt), "--ckpt-step", str(SAVED_AT),
                                                           *extra])
    assert proc.returncode == 0, proc.stdout[-4000:]
    resumed = logged_losses(metrics)
    assert len(resumed) == ITERS - SAVED_AT, resumed
    return resumed


def test_distributed_optimizer_resumes_at_dp2_and_reshards_to_dp1(tmp_path):
    ckpt = tmp_path / "ckpt"
    full = losses(tmp_path, "full", 4, DIST_OPT + ["--save", str(ckpt), "--save-interval", str(SAVED_AT)])
    assert (ckpt / f"iter_{SAVED_AT:07d}" / "megatron_async.json").is_file()
    tail = full[SAVED_AT:]
    assert_same(_resumed(tmp_path, "dp2", 4, ckpt), tail)
    dp1 = _resumed(tmp_path, "dp1", 2, ckpt)
    assert _close(dp1, tail, RESHARD_RTOL), (dp1, tail)
    fresh = _resumed(tmp_path, "fresh_optimizer", 2, ckpt, ["--no-load-optim"])
    assert not _close(fresh, tail, RESHARD_RTOL), "a resume without the optimizer's state must differ"

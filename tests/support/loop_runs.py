"""A small GPT trained in Megatron's own loop (`megatron.training.pretrain`) on warm gloo ranks.

The flags every such test starts from, one run with its `--metrics-json`, the losses it
logged, and the relative comparison of two loss curves. Tests pass their own flags after
these (argparse keeps the last value of a flag given twice).
"""

from __future__ import annotations

import json
import math

from tests.support.warm_launch import warm_run

# what the launcher adds on a machine without CUDA (megatron_async/launch.py): these fused kernels
# exist only as CUDA extensions; gradient-accumulation fusion stays on (the CPU emulation has its kernel)
CPU = ["--transformer-impl", "local", "--distributed-backend", "gloo",
       "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-persist-layer-norm",
       "--no-rope-fusion", "--use-cpu-initialization"]
MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--untie-embeddings-and-output-weights", "--position-embedding-type", "learned_absolute",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--layout-invariant-init"]
ITERS = 8
TRAIN = ["--train-iters", str(ITERS), "--lr", "2e-3", "--log-interval", "1", "--eval-interval", "1000",
         "--eval-iters", "1", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256",
         "--num-workers", "0", "--rerun-mode", "disabled"]
# fp32 on the CPU: a pipeline changes no reduction order inside a layer, so two runs of one
# trajectory agree to round-off (observed bitwise)
RTOL = 1e-6
TIMEOUT_S = 300
LAUNCH = "megatron_async.launch"


def run(tmp_path, name, nproc, extra, module=LAUNCH, env=None, model=None, peers_exit_s=0.0):
    """(the finished job, its metrics path). `model`: the model flags, MODEL by default (read at
    call time, so a test may patch it); `peers_exit_s`: for tests of what every rank prints as it
    exits (warm_launch.WarmJob.wait)."""
    metrics = tmp_path / f"{name}.jsonl"
    proc = warm_run(module, ["--gpt", *CPU, *(MODEL if model is None else model), *TRAIN, "--metrics-json",
                             str(metrics), *extra], nproc, TIMEOUT_S, env=env, peers_exit_s=peers_exit_s)
    return proc, metrics


def records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def logged_losses(*paths) -> list[float]:
    """The training losses of metrics files, in order (a resumed run: first part, then the rest)."""
    return [r["lm_loss"] for path in paths for r in records(path) if "lm_loss" in r]


def losses(tmp_path, name, nproc, extra, **kw) -> list[float]:
    """The losses of a run that must finish and log ITERS finite ones."""
    proc, metrics = run(tmp_path, name, nproc, extra, **kw)
    assert proc.returncode == 0, proc.stdout[-4000:]
    found = logged_losses(metrics)
    assert len(found) == ITERS and all(math.isfinite(x) for x in found), found
    return found


def assert_same(a, b, rtol=RTOL):
    """Each loss of `a` within `rtol` relative of `b`'s at the same iteration (callers that need
    equal counts get them from `losses`)."""
    for i, (x, y) in enumerate(zip(a, b), 1):
        assert abs(x - y) <= rtol * abs(y), f"iteration {i}: {x} vs {y} (rtol {rtol})"

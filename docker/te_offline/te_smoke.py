"""Transformer Engine's first check on a GPU node: it imports, and an fp8 te.Linear trains a step.

Run by docker/te_offline/te_node_setup.sh after the install, before anything trains with TE:
`import transformer_engine.pytorch`, then one te.Linear forward and backward under fp8 (delayed
scaling, hybrid format) and the same weights in bf16. It passes when every output and gradient
is finite and the fp8 output differs from the bf16 one by more than nothing (fp8 was really
used) and by less than `--tolerance` (relative), and when Megatron-Core imports its TE layers
and takes TE's fused Adam. The result, with the versions that ran, goes to `--json`
(docker/te_offline/te_setup_report.py reads it).

    PYTHONPATH=/tmp/site python3 docker/te_offline/te_smoke.py --json $OUT/te_smoke.json
"""

import argparse
import json
import sys
import time
import traceback


def _relative(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def smoke(result: dict, tolerance: float) -> None:
    """Fill result as it goes, so that an exception leaves the stage it stopped at."""
    result.update(ok=False, stage="import torch")
    t0 = time.perf_counter()
    import torch

    result.update(torch=torch.__version__, torch_git=torch.version.git_version, cuda=torch.version.cuda,
                  cuda_available=torch.cuda.is_available())
    result["stage"] = "import transformer_engine.pytorch"
    import transformer_engine
    import transformer_engine.pytorch as te
    import transformer_engine_torch
    from transformer_engine.common.recipe import DelayedScaling, Format

    result.update(te=transformer_engine.__version__, te_path=transformer_engine.__file__,
                  te_torch_path=transformer_engine_torch.__file__, import_s=round(time.perf_counter() - t0, 2))
    if not torch.cuda.is_available():
        result["stage"] = "no CUDA device"
        return
    result.update(device=torch.cuda.get_device_name(), capability=".".join(map(str, torch.cuda.get_device_capability())))
    available, reason = te.is_fp8_available(return_reason=True)
    result.update(fp8_available=bool(available), fp8_reason=reason or "")
    if not available:
        result["stage"] = "fp8 not available"
        return

    result["stage"] = "fp8 te.Linear forward and backward"
    torch.manual_seed(0)
    layer = te.Linear(1024, 1024, params_dtype=torch.bfloat16).cuda()
    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    recipe = DelayedScaling(fp8_format=Format.HYBRID)
    with te.fp8_autocast(enabled=True, fp8_recipe=recipe):
        y8 = layer(x)
    y8.float().square().mean().backward()
    dx8, dw8 = x.grad.clone(), layer.weight.grad.clone()
    x.grad, layer.weight.grad = None, None
    y16 = layer(x)
    y16.float().square().mean().backward()
    torch.cuda.synchronize()
    tensors = {"y": y8, "dx": dx8, "dw": dw8}
    result["finite"] = {k: bool(torch.isfinite(v).all()) for k, v in tensors.items()}
    result["fp8_vs_bf16"] = {"y": _relative(y8, y16), "dx": _relative(dx8, x.grad),
                             "dw": _relative(dw8, layer.weight.grad)}
    result["tolerance"] = tolerance
    differs = result["fp8_vs_bf16"]["y"] > 0.0
    within = all(v < tolerance for v in result["fp8_vs_bf16"].values())
    result["stage"] = "megatron-core with TE"
    from megatron.core.extensions import transformer_engine as megatron_te  # noqa: F401
    import megatron.core
    import megatron.core.optimizer as megatron_optimizer

    # Megatron takes TE's FusedAdam where it imports, else torch's AdamW (the path the runs
    # without TE took); the Adam cases under TE are meant to run the former.
    adam = megatron_optimizer.Adam
    result.update(megatron_core=megatron.core.__version__, megatron_adam=f"{adam.__module__}.{adam.__name__}")
    fused = adam.__module__.startswith("transformer_engine")
    result["stage"] = "done" if all(result["finite"].values()) and differs and within and fused else \
        "fp8 output not finite, equal to bf16, beyond the tolerance, or Megatron without TE's Adam"
    result["ok"] = result["stage"] == "done"
    result["total_s"] = round(time.perf_counter() - t0, 2)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="te_smoke.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--tolerance", type=float, default=0.1,
                        help="largest relative difference of fp8 from bf16 (output and gradients)")
    args = parser.parse_args(argv)
    result = {}
    try:
        smoke(result, args.tolerance)
    except Exception as e:  # the report must say where it stopped, whatever stopped it
        result.update(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-4000:])
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "traceback"}, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

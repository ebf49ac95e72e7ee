"""What this machine offers the GPU acceptance suite, and the versions a result depends on.

    python -m tests.support.gpu.env          # one JSON object on stdout

The suite's conftest runs this module in a subprocess once per session (only
where CUDA is present), so importing Transformer Engine, and any crash doing so,
happens outside pytest's process; the same JSON heads the suite's report, since a
GPU number means little without the device and the torch / TE / NCCL / CUDA
versions that produced it.
"""

from __future__ import annotations

import json
import subprocess
import sys


def _package_version(*names: str) -> str | None:
    from importlib import metadata

    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def fp8_support() -> tuple[bool, str]:
    """(supported, reason) from Transformer Engine: `is_fp8_available(return_reason=True)`
    in TE 2.x, `transformer_engine.pytorch.fp8.check_fp8_support()` in older releases."""
    import transformer_engine.pytorch as te

    if hasattr(te, "is_fp8_available"):
        try:
            ok, reason = te.is_fp8_available(return_reason=True)
            return bool(ok), str(reason)
        except TypeError:  # a release whose is_fp8_available takes no argument
            pass
    from transformer_engine.pytorch.fp8 import check_fp8_support

    ok, reason = check_fp8_support()
    return bool(ok), str(reason)


def _transformer_engine() -> dict:
    try:
        import transformer_engine
        import transformer_engine.pytorch  # noqa: F401 - what the suite needs importable
    except Exception as err:  # noqa: BLE001 - any failure means "not usable here"
        return {"te": False, "te_error": f"{type(err).__name__}: {err}"}
    version = getattr(transformer_engine, "__version__", None) or _package_version(
        "transformer_engine", "transformer-engine", "transformer_engine_torch")
    out = {"te": True, "te_version": version}
    try:
        out["fp8"], out["fp8_reason"] = fp8_support()
    except Exception as err:  # noqa: BLE001
        out["fp8"], out["fp8_reason"] = False, f"fp8 check failed: {type(err).__name__}: {err}"
    return out


def _driver() -> str | None:
    try:
        proc = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = proc.stdout.strip().splitlines()
    return lines[0].strip() if proc.returncode == 0 and lines else None


def _megatron_version() -> str | None:
    version = _package_version("megatron-core", "megatron_core")
    if version is None:  # a source checkout installed under another name
        try:
            from megatron.core.package_info import __version__ as version
        except Exception:  # noqa: BLE001
            return None
    return version


def _nccl_version(torch) -> str | None:
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - a torch built without NCCL
        return None
    return ".".join(map(str, version)) if isinstance(version, (tuple, list)) else str(version)


def describe() -> dict:
    """Device, counts and versions; TE and fp8 only where CUDA is present."""
    import torch

    out = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
           "megatron_core": _megatron_version()}
    if not out["cuda_available"]:
        return out
    props = torch.cuda.get_device_properties(0)
    out.update(
        gpu_count=torch.cuda.device_count(),
        device=torch.cuda.get_device_name(0),
        capability=f"{props.major}.{props.minor}",
        memory_gib=round(props.total_memory / 2**30, 1),
        cuda=torch.version.cuda,
        cudnn=torch.backends.cudnn.version(),
        nccl=_nccl_version(torch),
        driver=_driver(),
    )
    out.update(_transformer_engine())
    return out


def probe(timeout_s: float = 300) -> dict:
    """`describe()` run in a fresh interpreter (TE's import stays out of the caller).
    A probe that fails reports TE as unusable, with the reason."""
    from tests.support.gpu.launch import subprocess_env

    try:
        proc = subprocess.run([sys.executable, "-m", "tests.support.gpu.env"], capture_output=True,
                              text=True, timeout=timeout_s, env=subprocess_env())
        if proc.returncode == 0:
            return json.loads(proc.stdout.strip().splitlines()[-1])
        why = (proc.stderr or proc.stdout)[-2000:]
    except (subprocess.TimeoutExpired, ValueError, IndexError) as err:
        why = f"{type(err).__name__}: {err}"
    return {"te": False, "te_error": f"environment probe failed: {why}", "fp8": False, "fp8_reason": "no probe"}


if __name__ == "__main__":
    print(json.dumps(describe()))

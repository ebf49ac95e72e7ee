"""The GPU acceptance suite (`make test-gpu`): skipped as a whole without CUDA.

Markers say what else a test needs: `gpus(n)` at least n GPUs, `te` Transformer
Engine, `fp8` TE's fp8 on this GPU; a test whose need is not met is skipped with
the reason. Where CUDA is present the environment is probed once (in a
subprocess, tests/support/gpu/env.py) and everything the session ran is written to
$MEGATRON_ASYNC_GPU_REPORT/report.json (default out/gpu), to be quoted in
docs/benchmarks.md.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.gpu.report import ENV_VAR, GpuReport

HERE = Path(__file__).resolve().parent
NO_CUDA = ("the GPU acceptance suite needs a CUDA GPU and found none, so every test in tests/gpu is skipped "
           "(run `make test-gpu` on a GPU node)")
_SESSION: dict = {"mine": set(), "report": None, "environment": None, "written": None, "no_cuda": False}


def _cuda() -> tuple[bool, int]:
    try:
        import torch

        return torch.cuda.is_available(), torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - a broken torch is "no CUDA" to this suite
        return False, 0


def _is_mine(item) -> bool:
    path = getattr(item, "path", None) or item.fspath  # `path` from pytest 7 on
    return HERE in Path(str(path)).resolve().parents


def pytest_configure(config):
    config.addinivalue_line("markers", "gpus(n): needs at least n CUDA GPUs")
    config.addinivalue_line("markers", "te: needs Transformer Engine")
    config.addinivalue_line("markers", "fp8: needs Transformer Engine's fp8 on this GPU")
    if not config.pluginmanager.hasplugin("timeout"):
        config.addinivalue_line("markers", "timeout(seconds): pytest-timeout's limit (ignored without it)")


def _skip_reason(item, count: int, env: dict) -> str | None:
    marker = item.get_closest_marker("gpus")
    need = marker.args[0] if marker else 1
    if count < need:
        return f"needs {need} GPUs, this node has {count}"
    if (item.get_closest_marker("te") or item.get_closest_marker("fp8")) and not env.get("te"):
        return f"needs Transformer Engine ({env.get('te_error', 'not importable')})"
    if item.get_closest_marker("fp8") and not env.get("fp8"):
        return f"needs fp8 support ({env.get('fp8_reason') or 'TE says no'})"
    return None


def pytest_collection_modifyitems(config, items):
    mine = [item for item in items if _is_mine(item)]
    if not mine:
        return
    _SESSION["mine"] = {item.nodeid for item in mine}
    cuda, count = _cuda()
    if not cuda:
        _SESSION["no_cuda"] = True
        for item in mine:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        return
    from tests.support.gpu.env import probe

    env = probe()  # a fresh interpreter: no CUDA context or TE import in pytest's own process
    env.setdefault("gpu_count", count)
    _SESSION["environment"] = env
    _SESSION["report"] = GpuReport(env)
    for item in mine:
        reason = _skip_reason(item, count, env)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


def pytest_runtest_logreport(report):
    gpu_report = _SESSION["report"]
    if gpu_report is None or report.nodeid not in _SESSION["mine"]:
        return
    if report.when == "call" or (report.when == "setup" and not report.passed):
        reason = None
        if report.skipped and isinstance(report.longrepr, tuple):
            reason = report.longrepr[2]
        elif report.failed:
            reason = str(report.longrepr)[-3000:]
        gpu_report.outcome(report.nodeid, report.outcome, report.duration, reason)


def pytest_sessionfinish(session, exitstatus):
    if _SESSION["report"] is not None:
        _SESSION["written"] = _SESSION["report"].write()


def pytest_terminal_summary(terminalreporter):
    if _SESSION["no_cuda"]:
        terminalreporter.write_line(NO_CUDA, yellow=True, bold=True)
    if _SESSION["written"]:
        terminalreporter.write_line(f"GPU acceptance suite: report written to {_SESSION['written']} "
                                    f"(directory from ${ENV_VAR})")


@pytest.fixture
def gpu_env() -> dict:
    """The probed environment (device, counts, versions, TE, fp8)."""
    return _SESSION["environment"] or {}


@pytest.fixture
def gpu_record(request):
    """record(**values): store values under this test's id in the session's report."""

    def record(**values):
        if _SESSION["report"] is not None:
            _SESSION["report"].record(request.node.nodeid, **values)

    return record

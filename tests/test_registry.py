"""Schedule registry: Megatron's schedules by name, clear errors for unknown names."""

import pytest

from megatron_async.schedules import registry


def test_megatron_schedules_are_registered():
    from megatron.core.pipeline_parallel import schedules as mcore

    assert registry.get_forward_backward_func("1f1b") is mcore.forward_backward_pipelining_without_interleaving
    assert registry.get_forward_backward_func("interleaved-1f1b") is mcore.forward_backward_pipelining_with_interleaving
    assert registry.get_forward_backward_func("no-pipelining") is mcore.forward_backward_no_pipelining


def test_unknown_schedule_lists_registered_names():
    with pytest.raises(ValueError) as err:
        registry.get_forward_backward_func("zero-bubble-v")
    message = str(err.value)
    assert "--pipeline-schedule" in message
    for name in registry.available_schedules():
        assert name in message


def test_register_and_update(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    registry.register_schedule("toy", description="x", forward_backward_func=len)
    assert registry.get_forward_backward_func("toy") is len
    registry.register_schedule("toy", generator=sorted)
    assert registry.get_schedule_generator("toy") is sorted
    assert registry.get_forward_backward_func("toy") is len


def test_readme_schedule_table_lists_every_registered_schedule_where_it_runs():
    """README's "Schedules" table: every registered name, in the row that says whether
    Megatron's loop runs it."""
    import pathlib
    import re

    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Schedules", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            for name in re.findall(r"`([^`]+)`", cells[0]):
                rows[name] = cells[2].startswith("yes")
    for name in registry.available_schedules():
        assert name in rows, f"README's schedule table does not list {name}"
        spec = registry.get_schedule(name)
        runnable = spec.forward_backward_func is not None or spec.run is not None  # Megatron's function, or our run
        assert rows[name] == runnable, f"README says the wrong thing of {name}'s runtime"

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

"""Test support: multi-rank gloo harness and tiny Megatron GPT builders.

Used by tests/, bench/ and the GPU suites from a checkout (imported as `tests.support`,
with the checkout on sys.path: `python -m pytest` and `python -m bench...` from its root,
pytest.ini's `pythonpath`, and the launchers' PYTHONPATH for the processes they start).
Not part of the wheel: nothing in megatron_async imports it (tests/test_packaging.py).
"""

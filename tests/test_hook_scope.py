"""Hooks stay scoped to their call: no module of the shipped package replaces a torch
function while Megatron runs, or rebinds a method on a live object. The collective audit
(tests/test_megatron_loop.py) proves what the scoped versions do: under 2bw the MoE
metrics and the layer-wise optimizer's statistics stay inside a stage."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATTERNS = {
    "a torch.distributed function replaced": re.compile(r"^\s*torch\.distributed\.\w+\s*=[^=]"),
    "a method rebound on an instance": re.compile(r"MethodType\("),
}


def _offences(folder: Path) -> list:
    return [f"{path.relative_to(folder)}:{n}: {what}" for path in sorted(folder.rglob("*.py"))
            for n, line in enumerate(path.read_text().splitlines(), 1)
            for what, pattern in PATTERNS.items() if pattern.search(line)]


def test_no_global_replacement_or_method_rebinding_in_the_package(tmp_path):
    assert not _offences(ROOT / "megatron_async")
    # control: the scan finds both kinds
    (tmp_path / "planted.py").write_text("torch.distributed.all_reduce = f\nobj.m = types.MethodType(g, obj)\n")
    assert len(_offences(tmp_path)) == 2

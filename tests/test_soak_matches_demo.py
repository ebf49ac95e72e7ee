"""The soak's `--model demo --optimizer muon` runs what `make demo` runs (examples/demo.sh):
its memory verdict in docs/benchmarks.md stands for the demo only if the sizes and Muon
flags are the demo's."""

import re
from pathlib import Path

from bench.overhead import soak

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo.sh"


def _demo_flags() -> dict:
    """{flag: value} of demo.sh's train_args, its ${VAR:-default} values resolved to the defaults."""
    text = DEMO.read_text()
    defaults = dict(re.findall(r"^(\w+)=\$\{\w+:-([^}]*)\}", text, re.M))
    block = text.split("train_args=(", 1)[1].split("\n)", 1)[0]
    code = "\n".join(line.split("#", 1)[0] for line in block.splitlines())
    flags = {}
    for flag, value in re.findall(r"(--[a-z0-9-]+)(?:[ \t]+([^\s-][^\s]*))?", code):
        value = value.strip('"')
        var = re.fullmatch(r"\$(\w+)", value)
        flags[flag] = defaults[var.group(1)] if var else value
    return flags


def _pairs(argv: list) -> dict:
    assert len(argv) % 2 == 0, argv
    return dict(zip(argv[::2], argv[1::2]))


def test_demo_model_and_muon_flags_are_the_demos():
    demo = _demo_flags()
    ours = {**_pairs(soak.SIZES["demo"]), **_pairs(soak.OPTIMIZER_FLAGS["muon"])}
    assert ours == {flag: demo[flag] for flag in ours}
    # the layers and heads every soak model shares are the demo's too
    shared = {flag: soak.MODEL[soak.MODEL.index(flag) + 1] for flag in ("--num-layers", "--num-attention-heads")}
    assert shared == {flag: demo[flag] for flag in shared}

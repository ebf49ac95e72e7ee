"""The pipeline package takes Megatron's process groups from the run (StageContext.groups,
Megatron-Core's ProcessGroupCollection, built once by TwoBWRun), never from Megatron's global
parallel state: a test or a second model can hand it other groups. Control: a planted read
is found."""

import re
from pathlib import Path

PIPELINE = Path(__file__).resolve().parent.parent / "megatron_async" / "pipeline"
GLOBAL_STATE = re.compile(r"\bparallel_state\b|get_args\(\)|_GLOBAL_ARGS")


def _global_reads(root: Path) -> list[str]:
    return [f"{path.name}:{n}" for path in sorted(root.rglob("*.py"))
            for n, line in enumerate(path.read_text().splitlines(), 1) if GLOBAL_STATE.search(line)]


def test_the_pipeline_package_reads_no_global_parallel_state(tmp_path):
    assert _global_reads(PIPELINE) == []
    (tmp_path / "planted.py").write_text("from megatron.core import parallel_state\n")
    assert _global_reads(tmp_path) == ["planted.py:1"]

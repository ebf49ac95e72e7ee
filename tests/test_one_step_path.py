"""One step path: the delayed optimizer step's sequence (tied link, stash snapshot, stale
global norm, finite check, .grad cleared) lives in pipeline/delayed_step.py alone, and both
the Megatron optimizer wrap and the tests' self-stepping 2bw runner call it; the twin
equivalences and resumes prove what it does. Control: the scan finds a second copy planted beside it."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEP = re.compile(r"\.optimizer_step\(\)")


def _entries(folder: Path) -> list:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*.py") if STEP.search(p.read_text()))


def test_the_step_sequence_lives_in_one_function(tmp_path):
    assert _entries(ROOT / "megatron_async") == ["pipeline/delayed_step.py"]
    for caller in ("megatron_async/megatron_lm/adapter/runtime.py", "tests/support/two_bw_trainer.py"):
        assert "delayed_optimizer_step(" in (ROOT / caller).read_text(), caller
    (tmp_path / "copy.py").write_text("with stash.optimizer_step():\n    optimizer.step()\n")
    (tmp_path / "delayed_step.py").write_text("with stash.optimizer_step():\n    pass\n")
    assert len(_entries(tmp_path)) == 2

"""The 2bw run and its `--simulated-delay 1` twin as README and docs/two_bw.md give them.

- Both examples carry what the twins' equality needs: the same initial weights
  (`--layout-invariant-init`) and no dropout. README's Schedules block runs its commands
  from the venv (`.venv/bin/...`, as its other blocks do), and its shared flags pass
  Megatron's argument validation with the plugin for both commands.
- Why no dropout: with Megatron's default 0.1 each layout draws other dropout masks, and
  the twins' losses differ from the first iteration. Their equality without dropout is
  tests/test_twin_matrix.py's (test_2bw_equals_its_twin).
"""

import re
import shlex
from pathlib import Path

from tests.support.loop_runs import MODEL, logged_losses, run
from tests.support.refusals import check_in_one_process

REPO = Path(__file__).resolve().parent.parent
EQUAL_TWINS = ("--layout-invariant-init", "--hidden-dropout 0", "--attention-dropout 0")


def _schedules_block() -> str:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## Schedules", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    return block


def _common(block: str) -> str:
    """The value of the block's COMMON="..." (continuation lines joined)."""
    return " ".join(re.search(r'COMMON="(.*?)"', block.replace("\\\n", " "), flags=re.S).group(1).split())


def test_both_examples_start_the_twins_equal_without_dropout():
    two_bw = (REPO / "docs" / "two_bw.md").read_text(encoding="utf-8")
    for name, common in (("README.md", _common(_schedules_block())), ("docs/two_bw.md", _common(two_bw))):
        for flags in EQUAL_TWINS:
            assert flags in common, f"{name}'s twin example lacks {flags}: {common}"


def test_the_readme_schedules_block_runs_from_the_venv_and_its_flags_pass_validation(tmp_path):
    block = _schedules_block().replace("\\\n", " ")
    commands = [line.strip() for line in block.splitlines()
                if line.strip() and not line.lstrip().startswith("#") and not line.startswith("COMMON=")
                and not line.startswith(" ")]
    assert commands and all(c.startswith(".venv/bin/") for c in commands), commands
    common = shlex.split(_common(block))
    runs = {c.split("megatron-async-pretrain $COMMON", 1)[1].strip(): int(c.split("--nproc-per-node ")[1].split()[0])
            for c in commands if "megatron-async-pretrain $COMMON" in c}
    assert len(runs) == 2, commands
    found = check_in_one_process({extra: {"world": world, "argv": common + shlex.split(extra)}
                                  for extra, world in runs.items()}, tmp_path)
    for extra, result in found.items():
        assert not result["refused"], (extra, result["error"])


def test_with_megatrons_default_dropout_the_twins_differ_at_the_first_iteration(tmp_path):
    model = [a for a in MODEL if a not in ("--hidden-dropout", "--attention-dropout", "0")]
    assert "--layout-invariant-init" in model and "--hidden-dropout" not in model  # Megatron's default, 0.1
    short = ["--train-iters", "1"]
    losses = {}
    for name, nproc, extra in (("2bw", 2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw"]),
                               ("twin", 1, ["--simulated-delay", "1", "--simulated-pipeline-stages", "2"])):
        proc, metrics = run(tmp_path, name, nproc, extra + short, model=model)
        assert proc.returncode == 0, proc.stdout[-4000:]
        losses[name] = logged_losses(metrics)
    assert len(losses["2bw"]) == len(losses["twin"]) == 1, losses
    assert losses["2bw"][0] != losses["twin"][0], losses

"""Which flags of public Megatron recipes a 2bw run loses, and why: one process for all.

    python -m tests.support.recipe_survey ROOT OUT.json

Each recipe (tests/support/recipes/*.json: a published flag set, its source, world size
and the environment variables its script sets) goes through megatron_async.check_flags
(Megatron's parser and `validate_args` with the plugin, the launcher's CPU flags added)
with `--pipeline-schedule 2bw` and the recipe's `survey_adds` (PP=2 where the recipe
has PP=1). While the command line is refused, the flag the message names is recorded
and dropped (or replaced, where the recipe says what a user would pass instead), and
the check runs again. Each refused flag is also checked under Megatron's own schedule,
on the recipe's command line with only this machine's refusals dropped: refused there
with the same message, it is refused by this machine (no Transformer Engine or GPU, a
path that is not here, a value Megatron-Core 0.19.2 refuses anywhere), not by 2bw.
Otherwise it is 2bw's, also where Megatron's own check refuses it because a flag 2bw
refused is gone (the Megatron-FSDP options without --use-megatron-fsdp). Path variables (`${NAME}`) become ROOT/NAME, which does not exist.

OUT.json maps each recipe to {"refusals": [{"flag", "by", "error", "on_this_machine"}],
"accepted": bool, "error": a refusal naming no flag of the recipe, or None}.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
from pathlib import Path

RECIPES = Path(__file__).with_name("recipes")
TWO_BW = ["--pipeline-schedule", "2bw"]
_FLAG = re.compile(r"--[a-z0-9][a-z0-9-]*")


def load_recipes() -> dict:
    """{name: the recipe's data} for every file in tests/support/recipes."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(RECIPES.glob("*.json"))}


def load_refusal_lists() -> dict:
    """tests/support/recipe_refusals.json: the flags 2bw refuses, each with its row of
    docs/megatron_lm.md's refusal table, and those this machine refuses whatever the schedule."""
    return json.loads(RECIPES.with_name("recipe_refusals.json").read_text())


def without(argv: list[str], flag: str) -> list[str]:
    """argv without `flag` and the values that follow it."""
    out, skipping = [], False
    for token in argv:
        if token.startswith("--"):
            skipping = token == flag
        if not skipping:
            out.append(token)
    return out


def command_line(recipe: dict, root: str) -> list[str]:
    """The recipe's flags with its paths under `root`, its own schedule flag removed, and
    the survey's additions in place of the recipe's values of those flags."""
    argv = [re.sub(r"\$\{(\w+)\}", lambda m: f"{root}/{m.group(1)}", token) for token in recipe["flags"]]
    adds = recipe.get("survey_adds", [])
    for flag in ["--pipeline-schedule"] + [t for t in adds if t.startswith("--")]:
        argv = without(argv, flag)
    return argv + adds


def named_flag(error: str, argv: list[str], unnamed: dict) -> str | None:
    """The first flag of argv that the message names, the schedule flag left out; else the
    flag of `unnamed` ({message text: flag}) whose text the message holds, if argv has it.
    Some of Megatron's messages name no flag ("Unsupported compute capability for
    GroupedGEMM kernels" is --moe-grouped-gemm without a GPU), or name another way to the
    same setting (a --pipeline-model-parallel-layout with more pieces than stages makes
    virtual stages)."""
    given = {t for t in argv if t.startswith("--")} - {"--pipeline-schedule"}
    found = next((f for f in _FLAG.findall(error) if f in given), None)
    return found or next((f for text, f in unnamed.items() if text in error and f in given), None)


@contextlib.contextmanager
def environment(values: dict):
    """The recipe script's environment variables (None: unset) for the duration."""
    saved = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, str(v))
        yield
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def _megatrons_refusal(check, argv: list[str], flag: str, world: int, unnamed: dict) -> str | None:
    """Megatron's own schedule's message refusing `flag` in argv, or None: the flags it
    refuses first are dropped until it refuses this one, accepts, or names no flag."""
    while True:
        result = check(argv, world, cpu_flags=True)
        first = named_flag(result["error"], argv, unnamed) if result["refused"] else None
        if first is None or first == flag:
            return result["error"] if first == flag else None
        argv = without(argv, first)


def survey(recipe: dict, root: str, check, unnamed: dict) -> dict:
    """The refusals of one recipe's command line under 2bw, in the order they come."""
    argv = command_line(recipe, root)
    with_2bw_refusals = argv  # the control's command line: only this machine's refusals dropped
    world, refusals = recipe["world_size"], []
    with environment(recipe.get("env", {})):
        while True:
            result = check(argv + TWO_BW, world, cpu_flags=True)
            if not result["refused"]:
                return {"refusals": refusals, "accepted": True, "error": None}
            flag = named_flag(result["error"], argv, unnamed)
            if flag is None:
                return {"refusals": refusals, "accepted": False, "error": result["error"]}
            here = _megatrons_refusal(check, with_2bw_refusals, flag, world, unnamed) == result["error"]
            refusals.append({"flag": flag, "by": result["by"], "error": result["error"], "on_this_machine": here})
            argv = without(argv, flag) + recipe.get("survey_replaces", {}).get(flag, [])
            if here:
                with_2bw_refusals = without(with_2bw_refusals, flag)


def main(root: str, out_path: str) -> None:
    import importlib

    from megatron_async.check_flags import check, prepare

    importlib.import_module("tests.support.warm_imports")  # each parse reuses the config docstrings
    prepare()
    lists = load_refusal_lists()
    unnamed = {entry["message"]: flag for section in lists.values() for flag, entry in section.items()
               if "message" in entry}
    results = {name: survey(recipe, root, check, unnamed) for name, recipe in load_recipes().items()}
    Path(out_path).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:])

"""Public Megatron recipes under 2bw: every flag 2bw refuses has a documented reason.

The flag sets of ten published training recipes (tests/support/recipes: Megatron-LM's
GPT-3, Llama-3, Mixtral, gpt-oss and DeepSeek-V3 examples, the Qwen3 MoE configurations
Megatron's MoE README points to, and the paper's SmolLM-360M) go through Megatron's
argument validation with the plugin, with `--pipeline-schedule 2bw` added, in one
process (tests/support/recipe_survey.py). A flag refused under 2bw but not under
Megatron's own schedule must be in the justified list (tests/support/recipe_refusals.json),
whose reasons are rows of docs/megatron_lm.md's refusal table; a flag this machine
refuses whatever the schedule (Transformer Engine, a GPU, a dataset) must be listed
apart with why. docs/megatron_lm.md's survey tables must say what the survey finds.
"""

import json
import re
from pathlib import Path

import pytest

from tests.support.recipe_survey import load_recipes, load_refusal_lists
from tests.support.warm_launch import warm_python

DOC = Path(__file__).resolve().parents[1] / "docs" / "megatron_lm.md"
RECIPES = load_recipes()
LISTS = load_refusal_lists()


@pytest.fixture(scope="module")
def survey(tmp_path_factory):
    folder = tmp_path_factory.mktemp("recipe_survey")
    proc = warm_python("tests.support.recipe_survey", [folder / "absent", folder / "out.json"], 300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return json.loads((folder / "out.json").read_text())


def _refused(found: dict, on_this_machine: bool) -> list[str]:
    return [r["flag"] for r in found["refusals"] if r["on_this_machine"] == on_this_machine]


def _section_rows(heading: str) -> list[list[str]]:
    """The table rows (cells) of the docs section under `heading`."""
    text = DOC.read_text()
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + 1)
    return [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in text[start:end if end > 0 else None].splitlines()
            if line.startswith("|") and not line.startswith("| ---")][1:]


def test_at_least_eight_recipes_each_with_its_source():
    assert len(RECIPES) >= 8
    for name, recipe in RECIPES.items():
        source = recipe["source"]
        assert source["repo"] and source["path"] and source["branch"], name
        assert recipe["flags"][0].startswith("--") and recipe["world_size"] >= 1, name
        assert not recipe["survey_adds"] or recipe.get("survey_adds_why"), name


@pytest.mark.parametrize("name", list(RECIPES))
def test_each_recipe_is_accepted_once_its_refused_flags_are_dropped(survey, name):
    """Every refusal names a flag of the recipe (or is a known message naming none)."""
    assert survey[name]["accepted"], survey[name]["error"]


def test_every_flag_2bw_refuses_is_in_the_justified_list(survey):
    unjustified = {(name, r["flag"], r["error"]) for name, found in survey.items() for r in found["refusals"]
                   if not r["on_this_machine"] and r["flag"] not in LISTS["refused_by_2bw"]}
    assert not unjustified, sorted(unjustified)
    # the survey finds refusals at all: a harness that accepted everything would pass the line above
    assert any(_refused(found, False) for found in survey.values())


def test_every_flag_this_machine_refuses_is_listed_with_why(survey):
    unlisted = {(name, r["flag"], r["error"]) for name, found in survey.items() for r in found["refusals"]
                if r["on_this_machine"] and r["flag"] not in LISTS["refused_on_this_machine"]}
    assert not unlisted, sorted(unlisted)
    assert all(entry["why"] for entry in LISTS["refused_on_this_machine"].values())


def test_no_flag_this_machine_refuses_is_one_2bw_refuses_on_a_gpu():
    """The docs say these are this machine's alone: none is in the plugin's lists of flags
    refused under 2bw, which apply on a GPU too."""
    from megatron_async.megatron_lm.adapter.flags import REFUSED_UNDER_2BW, SILENTLY_WRONG_UNDER_2BW

    refused_by_2bw = {flag for _, _, flag, _ in REFUSED_UNDER_2BW + SILENTLY_WRONG_UNDER_2BW}
    assert refused_by_2bw >= {"--fp16", "--use-megatron-fsdp", "--fp8-param-gather"}  # the lists are the ones meant
    machine_only = {flag for flag, entry in LISTS["refused_on_this_machine"].items()
                    if "also_refused_by_2bw" not in entry}
    assert not refused_by_2bw & machine_only
    # a flag Megatron refuses first in the recipe, which 2bw refuses on its own too, names 2bw's row
    also = {flag: entry["also_refused_by_2bw"] for flag, entry in LISTS["refused_on_this_machine"].items()
            if "also_refused_by_2bw" in entry}
    assert set(also) <= refused_by_2bw
    rows = {cells[0] for cells in _section_rows("## What is refused under 2bw, and why")}
    assert set(also.values()) <= rows, also


def test_each_justification_is_a_row_of_the_refusal_table():
    rows = {cells[0] for cells in _section_rows("## What is refused under 2bw, and why")}
    missing = {flag: entry["row"] for flag, entry in LISTS["refused_by_2bw"].items() if entry["row"] not in rows}
    assert not missing, missing


def _flags_in(cell: str) -> set[str]:
    return {m.split()[0] for m in re.findall(r"`(--[^`]+)`", cell)}


@pytest.mark.parametrize("name", list(RECIPES))
def test_the_docs_survey_table_says_what_the_survey_finds(survey, name):
    """Its row in docs/megatron_lm.md: the flags 2bw refuses (third column) and those this
    machine refuses (the second table) are the survey's."""
    title = RECIPES[name]["recipe"]
    (row,) = [cells for cells in _section_rows("## Public recipes under 2bw") if cells[0].startswith(title + " (")]
    assert _flags_in(row[2]) == set(_refused(survey[name], False)), row[2]
    (here,) = [cells for cells in _section_rows("### What this machine refuses in them")
               if cells[0] == title]
    assert _flags_in(here[1]) == set(_refused(survey[name], True)), here[1]

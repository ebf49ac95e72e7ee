"""The schedule registry is the one place that says what a schedule needs (its ScheduleSpec:
runner, run class, weight versions, flag checks): the flag checks, the Megatron hooks, the
planner, the save-space check and the simulator read the spec, not the name "2bw".

- A throwaway schedule registered with 2bw's runtime (builtin.TWO_BW_RUNTIME) gets 2bw's flag
  checks (its refusals, named with its own flag value), its run class and runner, and 2bw's
  memory plan (the stash, the point-to-point buffers); control: registered with 2bw's runner
  alone, the same flags are not 2bw's to refuse and the check says it has no Megatron function
  to run, and Megatron's 1F1B plans neither term.
- In process: a schedule registered by the test reaches --help, the refusals, the stash count
  and the simulator, and is removed after it.
- No module of the package compares the schedule's name with "2bw" (the dispatch cannot
  drift back to names).
"""

import argparse
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BASE = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "4096", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--max-position-embeddings", "16", "--num-layers", "2",
        "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "2", "--eval-interval", "10",
        "--lr", "1e-3", "--pipeline-model-parallel-size", "2"]



def test_a_registered_asynchronous_schedule_gets_2bw_checks_and_runtime():
    from tests.support.warm_launch import warm_python

    # one warm process (forked with Megatron imported): the registration and the CPU emulation stay in it
    proc = warm_python("tests.support.registered_schedule_probe", [json.dumps(BASE)], 300)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, proc.stdout[-6000:]
    found = json.loads(line[len("RESULT "):])
    new = found["throwaway-async"]
    assert new["delayed"] and new["runtime"] == "TwoBWRunner"
    assert not new["plain"]["refused"], new["plain"]
    assert new["refused_flag"]["refused"] and new["refused_flag"]["error"].startswith(
        "--pipeline-schedule throwaway-async: --log-params-norm"), new["refused_flag"]
    control = found["throwaway-sync"]
    assert not control["delayed"]
    assert control["plain"]["refused"] and "can only be simulated" in control["plain"]["error"], control["plain"]
    assert all(stage["stash"] > 0 and stage["p2p"] for stage in new["plan"]), new["plan"]
    assert all(stage["stash"] == 0 and not stage["p2p"] for stage in found["1f1b"]["plan"]), found["1f1b"]


def test_no_module_dispatches_on_the_name_2bw():
    pattern = re.compile(r"""(==|!=)\s*["']2bw["']|["']2bw["']\s*(==|!=)""")
    found = [f"{path.relative_to(ROOT)}:{n}" for path in sorted((ROOT / "megatron_async").rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, found


NEW = "throwaway-in-process"


@pytest.fixture
def registered():
    """An asynchronous schedule run by 2bw's runtime, registered for this test and removed after it;
    `gpipe` (registered, simulation only) is the control."""
    from megatron_async.schedules.builtin import TWO_BW_RUNTIME
    from megatron_async.schedules.registry import available_schedules, register_schedule, unregister_schedule

    register_schedule(NEW, description="a test's schedule", generator="megatron_async.schedules.generators:two_bw",
                      requires_pipeline=True, **TWO_BW_RUNTIME)
    yield NEW
    unregister_schedule(NEW)
    assert NEW not in available_schedules()


def _flags(schedule, **over):
    """What resolve_defaults and 2bw's checks read, as Megatron's validate_args leaves it (PP=2)."""
    return argparse.Namespace(**{
        "pipeline_schedule": schedule, "rank": 1, "rerun_mode": None, "pipeline_model_parallel_size": 2,
        "global_batch_size": 4, "micro_batch_size": 1, "data_parallel_size": 1, "overlap_grad_reduce": False,
        "gradient_accumulation_fusion": False, "virtual_pipeline_model_parallel_size": None,
        "untie_embeddings_and_output_weights": False, "mtp_num_layers": None, "delay_correction": "none",
        "save_params_interval": None, "pipeline_model_parallel_layout": None, "clip_grad_mode": "stage-local",
        "clip_grad": 1.0, "simulated_delay": 0, **over})


def test_a_registered_schedule_reaches_help_refusals_stash_and_simulator(registered, capsys):
    """In process: the new name is in --pipeline-schedule's --help choices and the simulator's
    --schedule choices (and simulates); its spec replaces Megatron's --rerun-mode default,
    refuses a flag naming the new schedule, and gives the save-space check (which the
    memory plan reads) its stash copy. Control: gpipe, registered without a runtime, gets
    none of the refusals, defaults or stash."""
    from megatron_async.megatron_lm.adapter import flags
    from megatron_async.megatron_lm.safety.save_space import stash_copies
    from megatron_async.schedules import simulate_cli
    from megatron_async.schedules.registry import get_schedule

    assert registered in flags.add_arguments(argparse.ArgumentParser()).format_help()
    assert registered in simulate_cli.simulated_schedules()
    assert simulate_cli.main(["--schedule", registered, "--pp", "2", "--microbatches", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["schedule"] == registered
    found = {}
    for name in (registered, "gpipe"):
        args = _flags(name)
        flags.resolve_defaults(args)
        get_schedule(name).check_flags(args)  # the valid command line passes
        try:
            get_schedule(name).check_flags(_flags(name, rerun_mode=args.rerun_mode, log_params_norm=True))
            refused = None
        except flags.FlagError as err:
            refused = str(err)
        found[name] = {"rerun_mode": args.rerun_mode, "refused": refused, "stash": stash_copies(args)}
    new = found[registered]
    assert new["rerun_mode"] == "disabled" and new["stash"] == 1, found
    assert new["refused"].startswith(f"--pipeline-schedule {registered}: --log-params-norm"), found
    assert found["gpipe"] == {"rerun_mode": "validate_results", "refused": None, "stash": 0}, found


"""The schedule registry is the one place that says what a schedule needs: the flag checks,
the Megatron hooks and the planner ask it (`registry.delayed_runtime`), not the name "2bw".

- A throwaway schedule registered with 2bw's runtime as asynchronous gets 2bw's flag checks
  (its refusals, named with its own flag value) and the registry hands out its runtime;
  control: registered without `asynchronous`, the same flags are not 2bw's to refuse and the
  check says it has no Megatron function to run.
- No module of the package compares the schedule's name with "2bw" (the dispatch cannot
  drift back to names).
"""

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "4096", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--max-position-embeddings", "16", "--num-layers", "2",
        "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "2", "--eval-interval", "10",
        "--lr", "1e-3", "--pipeline-model-parallel-size", "2"]

SCRIPT = """
import json, sys
from megatron_async.check_flags import check, prepare
from megatron_async.schedules.registry import delayed_runtime, get_runtime, register_schedule
prepare()
base = json.loads(sys.argv[1])
found = {}
for name, asynchronous in (("throwaway-async", True), ("throwaway-sync", False)):
    register_schedule(name, description="a test's schedule", generator="megatron_async.schedules.generators:two_bw",
                      runtime="megatron_async.pipeline.two_bw:TwoBWRunner", requires_pipeline=True,
                      asynchronous=asynchronous)
    argv = base + ["--pipeline-schedule", name]
    found[name] = {"plain": check(argv, 2, cpu_flags=True), "refused_flag": check(argv + ["--log-params-norm"], 2,
                   cpu_flags=True), "delayed": delayed_runtime(name), "runtime": get_runtime(name).__name__}
print("RESULT " + json.dumps(found))
"""


def test_a_registered_asynchronous_schedule_gets_2bw_checks_and_runtime():
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(BASE)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = json.loads(line[len("RESULT "):])
    new = found["throwaway-async"]
    assert new["delayed"] and new["runtime"] == "TwoBWRunner"
    assert not new["plain"]["refused"], new["plain"]
    assert new["refused_flag"]["refused"] and new["refused_flag"]["error"].startswith(
        "--pipeline-schedule throwaway-async: --log-params-norm"), new["refused_flag"]
    control = found["throwaway-sync"]
    assert not control["delayed"]
    assert control["plain"]["refused"] and "can only be simulated" in control["plain"]["error"], control["plain"]


def test_no_module_dispatches_on_the_name_2bw():
    pattern = re.compile(r"""(==|!=)\s*["']2bw["']|["']2bw["']\s*(==|!=)""")
    found = [f"{path.relative_to(ROOT)}:{n}" for path in sorted((ROOT / "megatron_async").rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, found

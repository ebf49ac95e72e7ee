"""A throwaway schedule registered in one process, run through the flag checks and the planner:
the findings of tests/test_schedule_registry_dispatch.py, printed as one `RESULT <json>` line.

    python -m tests.support.registered_schedule_probe BASE_ARGV_JSON
"""

import contextlib
import io
import json
import os
import sys
import tempfile


def main(argv: list) -> None:
    from megatron_async.check_flags import check, prepare
    from megatron_async.planning import plan
    from megatron_async.schedules.builtin import TWO_BW_RUNTIME
    from megatron_async.schedules.registry import get_schedule, register_schedule
    prepare()
    base = json.loads(argv[0])
    found = {}
    for name, asynchronous in (("throwaway-async", True), ("throwaway-sync", False)):
        runtime = TWO_BW_RUNTIME if asynchronous else {"runtime": TWO_BW_RUNTIME["runtime"]}
        register_schedule(name, description="a test's schedule", generator="megatron_async.schedules.generators:two_bw",
                          requires_pipeline=True, **runtime)
        flags = base + ["--pipeline-schedule", name]
        found[name] = {"plain": check(flags, 2, cpu_flags=True), "refused_flag": check(flags + ["--log-params-norm"], 2,
                       cpu_flags=True), "delayed": get_schedule(name).run_class() is not None,
                       "runtime": get_schedule(name).runner_class().__name__}
    for name in ("throwaway-async", "1f1b"):
        path = os.path.join(tempfile.mkdtemp(), "plan.json")
        with contextlib.redirect_stdout(io.StringIO()):
            plan.main(["--world-size", "2", "--json", path, "--", *base, "--pipeline-schedule", name])
        stages = json.load(open(path))["stages"]
        found.setdefault(name, {})["plan"] = [{"stash": s["memory_gb"]["stash"], "p2p": s["p2p"] is not None}
                                              for s in stages]
    print("RESULT " + json.dumps(found))


if __name__ == "__main__":
    main(sys.argv[1:])

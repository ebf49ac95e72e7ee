"""Several runs of the planner in one process, for tests that read more than one plan
(one start-up of Python and Megatron instead of one per plan).

    python -m tests.support.plans JOBS.json

JOBS.json: a list of {"world": WORLD_SIZE, "json": OUT_PATH, "argv": [ARGS...]}, each run
as `megatron_async.planning.plan --world-size WORLD_SIZE --json OUT_PATH -- ARGS` would be
(a plan that does not fit exits 1 with its JSON written); exits with the first non-zero
status.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys


def main(jobs_path: str) -> int:
    from megatron_async.planning import plan

    status = 0
    for job in json.loads(open(jobs_path, encoding="utf-8").read()):
        with contextlib.redirect_stdout(io.StringIO()):
            code = plan.main(["--world-size", str(job["world"]), "--json", job["json"], "--", *job["argv"]])
        status = status or code
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

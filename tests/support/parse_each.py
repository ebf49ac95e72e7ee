"""Megatron's argument parsing with the plugin for several command lines in one process.

    python -m tests.support.parse_each WORLD ATTRS CASES_JSON

For each command line of CASES_JSON (a JSON list of argument lists) it prints
`=== case`, whatever the parse printed (the plugin's one-line notices among it), and
`NAME=VALUE TYPE` for each comma-separated attribute in ATTRS of the parsed args. One
process for all cases: importing Megatron costs seconds a process, and the tests run
this from their warm forkserver (tests/support/warm_launch.warm_python).
"""

from __future__ import annotations

import json
import sys


def main(world: str, attrs: str, cases: str) -> None:
    from megatron_async.check_flags import parse, prepare

    prepare()
    for argv in json.loads(cases):
        print("=== case", flush=True)
        args = parse(argv, int(world))  # sets sys.argv
        for name in attrs.split(","):
            value = getattr(args, name)
            print(f"{name}={value!r} {type(value).__name__}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])

"""Check many command lines against Megatron's argument validation in one process.

    python -m megatron_async.testing.refusals CASES.json OUT.json

CASES.json maps a case name to {"world": N, "argv": [...]}. Each command line goes
through what the launcher's GPT entry runs first, Megatron's
`parse_and_validate_args` with the plugin installed (CPU flags added where CUDA is
absent), under WORLD_SIZE=N. OUT.json maps each name to {"refused": bool,
"error": the message of our FlagError, or of argparse's exit, or None}. One
process for all cases, since importing Megatron costs seconds a process; no
process group is ever created, as in a real refusal.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys


def check(argv: list[str], world: int) -> dict:
    """Whether Megatron's parser and validation, with our hooks, refuse `argv`, and the message."""
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.global_vars import unset_global_variables

    from megatron_async.launch import with_cpu_flags
    from megatron_async.megatron_lm.flags import FlagError

    os.environ.update(WORLD_SIZE=str(world), RANK="0", LOCAL_RANK="0")
    sys.argv = ["megatron_async.megatron_lm.gpt", *with_cpu_flags(list(argv))]
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(stderr):
            parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    except FlagError as err:
        return {"refused": True, "error": str(err)}
    except SystemExit:  # argparse: unknown flag, or a value outside the flag's choices
        lines = [line for line in stderr.getvalue().splitlines() if "error:" in line]
        return {"refused": True, "error": lines[-1] if lines else stderr.getvalue()}
    except Exception as err:  # noqa: BLE001 - Megatron's own checks assert; the test reads the text
        return {"refused": True, "error": f"{type(err).__name__}: {err}"}
    unset_global_variables()
    return {"refused": False, "error": None}


def main(cases_path: str, out_path: str) -> None:
    from megatron_async import cpu
    from megatron_async.megatron_lm.hooks import install

    cpu.setup_device("auto")
    install()
    with open(cases_path, encoding="utf-8") as f:
        cases = json.load(f)
    results = {name: check(case["argv"], case["world"]) for name, case in cases.items()}
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])

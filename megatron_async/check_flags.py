"""Check a training command line against Megatron's argument validation, without training.

    python -m megatron_async.check_flags --world-size 32 [--cpu-flags] -- ARGS...

Runs what the launcher runs first, Megatron's argument parser and `validate_args`
with the plugin installed (our flags and refusals, the data checks), with
--cpu-flags also what Megatron builds before training and checks there, the model's
TransformerConfig (whose checks include the pipeline split), the optimizer's and the
learning-rate scheduler's (megatron_lm/adapter/setup_checks.py), under WORLD_SIZE=N,
and prints `ok` or the one-line refusal
(exit 2). No process group is created and no model is built, so it runs on a login
node or in CI for a cluster-sized command line (examples/slurm dry runs).
Where CUDA is absent the CPU emulation answers Megatron's device queries; the
command line is checked as given unless --cpu-flags adds what CPU runs need.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys


def parse(argv: list[str], world: int, cpu_flags: bool = False):
    """Megatron's parsed and validated args for `argv` (our hooks run inside validation);
    raises FlagError (ours, and Megatron's own checks in validate_args and, with cpu_flags,
    in the configurations it builds before training) or SystemExit (argparse)."""
    from megatron.training import arguments

    from megatron_async.launch import GPT_PROG, with_cpu_flags
    from megatron_async.megatron_lm.adapter.setup_checks import for_another_machine

    os.environ.update(WORLD_SIZE=str(world), RANK="0", LOCAL_RANK="0")
    sys.argv = [GPT_PROG, *(with_cpu_flags(list(argv)) if cpu_flags else argv)]
    # parse_and_validate_args without its last step (building the tokenizer and the
    # global state): the tokenizer of a cluster job may not be on this machine. With
    # cpu_flags, a command line for this machine: the hooked validation builds the model's
    # and the training's configurations too (setup_checks.py), whose checks include an uneven
    # pipeline split that does not add up; a cluster's command line may ask for kernels
    # (TE's) this machine lacks, so there they are skipped
    with contextlib.nullcontext() if cpu_flags else for_another_machine():
        return arguments.validate_args(arguments.parse_args(), {"tokenizer_type": "NullTokenizer"})


def check(argv: list[str], world: int, cpu_flags: bool = False) -> dict:
    """{"refused": bool, "error": message or None, "by": who refused} for Megatron's parser
    and validation with our hooks, as the GPT entry runs them. "by" is "megatron-async"
    (our checks), "argparse" or "megatron" (Megatron's own assertions), None if accepted."""
    from megatron_async.megatron_lm.adapter.flags import FlagError
    from megatron_async.megatron_lm.adapter.megatron_asserts import MegatronArgumentError

    stderr = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(stderr):
            parse(argv, world, cpu_flags)
    except FlagError as err:  # Megatron's own checks in validate_args come as ours, naming the flag
        by = "megatron" if isinstance(err, MegatronArgumentError) else "megatron-async"
        return {"refused": True, "error": str(err), "by": by}
    except SystemExit:  # argparse: unknown flag, or a value outside the flag's choices
        lines = [line for line in stderr.getvalue().splitlines() if "error:" in line]
        error = lines[-1].split(": error: ", 1)[-1] if lines else stderr.getvalue()  # without argparse's prog
        return {"refused": True, "error": error, "by": "argparse"}
    except Exception as err:  # noqa: BLE001 - Megatron's checks outside validate_args; report their text
        import traceback

        where = traceback.extract_tb(err.__traceback__)[-1]
        detail = str(err) or f"{where.line} ({where.filename.split('site-packages/')[-1]}:{where.lineno})"
        return {"refused": True, "error": f"{type(err).__name__}: {detail}", "by": "megatron"}
    return {"refused": False, "error": None, "by": None}


def prepare() -> None:
    """The plugin's hooks, and the CPU emulation where CUDA is absent (once per process)."""
    from megatron_async import cpu
    from megatron_async.megatron_lm.adapter.hooks import install

    cpu.setup_device("auto")
    install()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, required=True, help="ranks of the job (nodes x GPUs per node)")
    parser.add_argument("--cpu-flags", action="store_true", help="add the flags a CPU run needs, as the launcher does")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="-- then the training command line")
    ns = parser.parse_args(argv)
    args = ns.args[1:] if ns.args[:1] == ["--"] else ns.args
    prepare()
    result = check(args, ns.world_size, ns.cpu_flags)
    if result["refused"]:
        print(f"megatron-async: error: {result['error']}", file=sys.stderr)
        return 2
    print(f"ok: {len(args)} arguments accepted by Megatron's validation and megatron-async at world size "
          f"{ns.world_size}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

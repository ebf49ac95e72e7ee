"""Run a Megatron-LM training script with the megatron-async plugin installed.

    torchrun --nproc-per-node 8 -m megatron_async.launch /path/to/Megatron-LM/pretrain_gpt.py ARGS...
    torchrun --nproc-per-node 2 -m megatron_async.launch --gpt ARGS...    # our GPT entry, no checkout

Installs the hooks (megatron_async.megatron_lm.adapter.hooks) and, only on a machine
without CUDA, the CPU emulation; then runs the script as `__main__` with ARGS as
its command line, so `--pipeline-schedule 2bw` and our other flags are parsed by
Megatron's own parser. A flag refused before training prints one line naming it
and exits 2 on every rank.
"""

from __future__ import annotations

import os
import runpy
import sys

# What Megatron needs to train on the CPU (no Transformer Engine, apex or fused CUDA
# kernels; gloo instead of NCCL). Added where CUDA is absent, unless the flag is given.
# Gradient-accumulation fusion stays on, as on GPUs: the CPU emulation provides its
# kernel (`--no-gradient-accumulation-fusion` still turns it off).
CPU_FLAGS = (
    ("--transformer-impl", "local"), ("--distributed-backend", "gloo"), ("--no-masked-softmax-fusion",),
    ("--no-bias-gelu-fusion",), ("--no-bias-swiglu-fusion",), ("--no-bias-dropout-fusion",),
    ("--no-persist-layer-norm",), ("--no-rope-fusion",), ("--use-cpu-initialization",),
)


def with_cpu_flags(args: list[str]) -> list[str]:
    given = {a.split("=", 1)[0] for a in args if a.startswith("--")}
    extra = [part for flag in CPU_FLAGS if flag[0] not in given for part in flag]
    return args + extra


def prepare() -> bool:
    """What every run through the launcher installs before Megatron starts: the CUDA and
    NCCL emulation where there is no CUDA, and the Megatron hooks. Returns whether on the CPU."""
    from megatron_async.megatron_lm.safety.launcher_watch import exit_with_launcher

    exit_with_launcher()
    from megatron_async import cpu

    on_cpu = cpu.setup_device("auto") == "cpu"
    from megatron_async.megatron_lm.adapter.hooks import install

    install()
    return on_cpu


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") and len(argv) == 1:
        print(__doc__)
        return 0 if argv else 2
    on_cpu = prepare()
    script, rest = argv[0], argv[1:]
    if on_cpu:
        rest = with_cpu_flags(rest)
    code = _run_and_finish(script, rest)
    if code:  # our refusal or stop: the process groups still hold gloo/NCCL threads, which
        from megatron_async.megatron_lm.safety import exit_flush

        exit_flush.before_exit(code)  # os._exit skips TensorBoard's and W&B's own flushes
        sys.stdout.flush()  # can abort a normal exit (SIGABRT) and so replace our exit code
        sys.stderr.flush()
        os._exit(code)
    return code


def _run_and_finish(script: str, rest: list[str]) -> int:
    from megatron_async.megatron_lm.safety import failures

    try:
        _run(script, rest)
    except SystemExit:  # Megatron's own exits (--exit-interval, ...) end training cleanly
        _finish()
        raise
    except Exception as err:
        ours = failures.our_line(err)
        if ours is None:
            failures.other_failure(err)
            raise
        failures.report(ours[0])
        return ours[1]
    _finish()
    return 0


# The program Megatron's parser names in its errors and --help (argparse's prog: sys.argv[0]) for
# the plugin's GPT entry; a training script's run keeps the script's own name.
GPT_PROG = "megatron-async"


def _run(script: str, rest: list[str]) -> None:
    if script == "--gpt":
        from megatron_async.megatron_lm.adapter import gpt

        sys.argv = [GPT_PROG, *rest]
        gpt.main()
    else:
        sys.argv = [script, *rest]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name="__main__")


def _finish() -> None:
    """After training: the metrics plot, then every rank leaves the process groups
    together (Megatron does not destroy them; gloo's threads then abort the exit)."""
    import torch.distributed as dist
    from megatron.training import get_args

    from megatron_async.megatron_lm.adapter import plugin_run

    if dist.is_initialized():
        run = plugin_run.current()
        if run is not None:
            run.metrics.finish(get_args().plot)
        dist.barrier()
        dist.destroy_process_group()


def main_gpt() -> int:
    """`megatron-async-pretrain ARGS`: the plugin's GPT entry in Megatron's loop (= launch --gpt ARGS)."""
    return main(["--gpt", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())

"""Run a Megatron-LM training script with the megatron-async plugin installed.

    torchrun --nproc-per-node 8 -m megatron_async.launch /path/to/Megatron-LM/pretrain_gpt.py ARGS...
    torchrun --nproc-per-node 2 -m megatron_async.launch --gpt ARGS...    # our GPT entry, no checkout

Installs the hooks (megatron_async.megatron_lm.hooks) and, only on a machine
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


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") and len(argv) == 1:
        print(__doc__)
        return 0 if argv else 2
    from megatron_async.launcher_watch import exit_with_launcher

    exit_with_launcher()
    from megatron_async import cpu

    on_cpu = cpu.setup_device("auto") == "cpu"
    from megatron_async.megatron_lm.hooks import install

    install()
    script, rest = argv[0], argv[1:]
    if on_cpu:
        rest = with_cpu_flags(rest)
    try:
        return _run_and_finish(script, rest)
    finally:
        if on_cpu:
            cpu.write_exit_report()


# torchrun names the failure with the earliest timestamp (whole seconds; a tie goes to
# the lowest rank). A rank with the cause records its error and leaves only once that
# second has passed, so every rank torchrun then stops, or that lost its connection to
# it, fails later and is not named instead; one that lost a peer also waits a moment
# before it fails, for the same reason.
PEER_LOSS_GRACE_S = 2.5
_PEER_LOSS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "NCCL communicator was aborted")


def _run_and_finish(script: str, rest: list[str]) -> int:
    from megatron_async.megatron_lm.flags import FlagError
    from megatron_async.megatron_lm.side_state import CheckpointStateError
    from megatron_async.pipeline.non_finite import NonFiniteError

    rank = os.environ.get("RANK", "0")
    try:
        _run(script, rest)
    except FlagError as err:
        return _failed(f"megatron-async: error: {err}", 2)
    except CheckpointStateError as err:
        return _failed(f"{err} (rank {rank})", 2)
    except NonFiniteError as err:
        return _failed(f"megatron-async: rank {rank}: stopped: {err}", 3)
    except SystemExit:  # Megatron's own exits (--exit-interval, ...) end training cleanly
        _finish()
        raise
    except Exception as err:
        import time

        if any(text in str(err) for text in _PEER_LOSS):
            print(f"megatron-async: rank {rank}: lost a peer rank ({type(err).__name__}); torchrun names the "
                  "rank that failed first", file=sys.stderr, flush=True)
            time.sleep(PEER_LOSS_GRACE_S)
        else:
            _record_error(f"rank {rank}: {type(err).__name__}: {err}")
        raise
    _finish()
    return 0


def _failed(line: str, code: int) -> int:
    """Our one line, last on this rank's stderr and in torchrun's failure summary."""
    print(line, file=sys.stderr, flush=True)
    _record_error(line)
    return code


def _record_error(message: str) -> None:
    """Write torchrun's per-worker error file (TORCHELASTIC_ERROR_FILE), which its
    summary quotes as this rank's failure with the second it happened; then let that
    second pass (see PEER_LOSS_GRACE_S)."""
    import json
    import time

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    now = time.time()
    data = {"message": {"message": message, "extraInfo": {"py_callstack": message, "timestamp": str(int(now))}}}
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f)
    except OSError:
        return
    time.sleep(int(now) + 1 - now + 0.05)


def _run(script: str, rest: list[str]) -> None:
    if script == "--gpt":
        from megatron_async.megatron_lm import gpt

        sys.argv = ["megatron_async.megatron_lm.gpt", *rest]
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

    from megatron_async.megatron_lm import metrics

    if dist.is_initialized():
        metrics.finish(get_args().plot)
        from megatron_async import cpu

        if cpu.is_active():  # before the group is destroyed, which aborts what is left
            cpu.write_exit_report()
        dist.barrier()
        dist.destroy_process_group()


def main_gpt() -> int:
    """`megatron-async-pretrain ARGS`: the plugin's GPT entry in Megatron's loop (= launch --gpt ARGS)."""
    return main(["--gpt", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())

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


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") and len(argv) == 1:
        print(__doc__)
        return 0 if argv else 2
    from megatron_async.launcher_watch import exit_with_launcher

    exit_with_launcher()
    from megatron_async import cpu

    cpu.setup_device("auto")
    from megatron_async.megatron_lm.flags import FlagError
    from megatron_async.megatron_lm.hooks import install

    install()
    script, rest = argv[0], argv[1:]
    try:
        if script == "--gpt":
            from megatron_async.megatron_lm import gpt

            sys.argv = ["megatron_async.megatron_lm.gpt", *rest]
            gpt.main()
        else:
            sys.argv = [script, *rest]
            sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
            runpy.run_path(script, run_name="__main__")
    except FlagError as err:
        print(f"megatron-async: error: {err}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

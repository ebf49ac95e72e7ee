"""`megatron-async-export-hf` with a chosen weight version, for the export tests' control.

    python -m tests.support.export_version live|stash LOAD OUT

`stash` exports the 2bw stash's older weights W(T-1) instead of the live W(T): what the
export must never do, and what the tests show to differ from Megatron's evaluation.
"""

import sys

from megatron_async.megatron_lm.export.cli import export

if __name__ == "__main__":
    version, load, out = sys.argv[1:4]
    export(load, out, version=version)

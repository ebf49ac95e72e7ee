"""`python -m megatron_async.testing.rank_exit R CODE`: rank R exits with CODE, the others wait.

A stand-in for a job whose rank R dies while its peers block in a collective: what
a launcher must stop (tests/test_harness.py drives warm_launch with it).
"""

import os
import sys
import time

if __name__ == "__main__":
    failing, code = int(sys.argv[1]), int(sys.argv[2])
    if int(os.environ["RANK"]) == failing:
        print(f"rank {failing}: exiting with {code} on purpose", flush=True)
        sys.exit(code)
    time.sleep(3600)

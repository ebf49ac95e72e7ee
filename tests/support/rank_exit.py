"""`python -m tests.support.rank_exit R CODE [AFTER_S PEER_CODE]`: rank R exits
with CODE; the others wait, for an hour or, given AFTER_S, exit with PEER_CODE after
AFTER_S seconds.

A stand-in for a job whose rank R dies while its peers block in a collective: what
a launcher must stop; and for ranks that all stop, one a little later than another
(tests/test_harness.py drives warm_launch with it).
"""

import os
import sys
import time

if __name__ == "__main__":
    failing, code = int(sys.argv[1]), int(sys.argv[2])
    after_s, peer_code = (float(sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 4 else (3600.0, 0)
    if int(os.environ["RANK"]) == failing:
        print(f"rank {failing}: exiting with {code} on purpose", flush=True)
        sys.exit(code)
    time.sleep(after_s)
    print(f"rank {os.environ['RANK']}: exiting with {peer_code} after {after_s:g} s", flush=True)
    sys.exit(peer_code)

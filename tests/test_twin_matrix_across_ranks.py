"""2bw equals its `--simulated-delay 1` twin in Megatron's loop: layouts with data, tensor or
expert parallelism (4 ranks; the twin at PP=1 on 2).

Cases and classes as in tests/test_twin_matrix.py (tests/support/twins.py).

With Megatron's distributed optimizer, every combination users set of what it reaches under a
delay: the embeddings tied or untied, x Adam + EF (fp32) or layer-wise Muon + EF (bf16), x
each overlap (--overlap-param-gather needs --overlap-grad-reduce). A pair left out is where a
wrong result hides: tied + layer-wise Muon + the parameter gather once gathered again right
before the last stage's step, through the gradient buffer that gather borrows, and lost that
stage's gradients (3e-3). Clipping is on (stage-local norm over each stage's DP ranks). Tied:
the first stage's new embeddings are gathered before they are sent to the last stage, and the
last stage's own gather lands before it installs them, without gathering again once a forward
did; the tied weight has its own bucket (the sum is added after its reduce-scatter, on the
shard both stages lay out alike). At TP=2 tied embeddings are vocabulary-parallel shards.
"""

import pytest

from tests.support.twins import SYNC, Case, check

DP2 = "PP=2 x DP=2, dist-opt"
OVERLAPS = (f"{DP2}, overlapped reduce", f"{DP2}, overlapped reduce and gather")
OPTIMIZER_TOLERANCE = {"adam+ef": "fp32", "muon+ef, layer-wise, bf16": "bf16"}
CASES = [Case(embeddings, overlap, optimizer, tolerance) for embeddings in ("untied", "tied")
         for optimizer, tolerance in OPTIMIZER_TOLERANCE.items() for overlap in OVERLAPS] + [
    # the tied weight's bucket reduced without an overlap: with EF, so that the overlapped rows'
    # twin serves it too (EF acts on the update, after every reduction)
    Case("tied", DP2, "adam+ef", "fp32"),
    Case("recipes' union: moe at ep2, bf16 grads", OVERLAPS[1], "adam", "bf16", SYNC),
    Case("untied", "PP=2 x TP=2, sequence parallel", "adam", "split", SYNC),
    Case("tied", "PP=2 x TP=2", "adam", "tied"),
    Case("moe, aux loss", "PP=2 x EP=2", "adam", "split"),
    Case("moe, aux loss", "PP=2 x EP=2", "muon", "split"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_2bw_equals_its_twin(tmp_path, case):
    check(case, tmp_path)

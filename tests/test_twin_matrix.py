"""2bw equals its `--simulated-delay 1` twin in Megatron's loop: the pipeline-only layouts.

Each case (feature | layout | optimizer) trains 2bw at PP=P and its twin at PP=1 on one
rank, and compares the losses iteration by iteration within the case's tolerance class;
the classes, their reasons and the negative controls are tests/support/twins.py's. The
layouts with data, tensor or expert parallelism: tests/test_twin_matrix_across_ranks.py.
"""

import pytest

from tests.support.loop_runs import MODEL, assert_same, logged_losses, run
from tests.support.twins import LINK_OFF, SYNC, Case, check, shared_losses, twin_flags, two_bw_flags

CASES = [
    Case("untied", "PP=2", "adam", "fp32", SYNC),
    Case("untied", "PP=2", "muon", "fp32"),
    Case("untied", "PP=2", "muon+ef", "fp32"),
    Case("rope, swiglu, rmsnorm, gqa", "PP=2", "adam", "fp32"),
    Case("full recompute", "PP=2", "adam", "fp32"),
    Case("selective recompute", "PP=2", "adam", "fp32"),
    # also every other iteration's validation loss, taken at the newest weights: the last stage
    # must have installed the first stage's newest weights first
    Case("tied", "PP=2", "adam", "tied", LINK_OFF, both=("--eval-interval", "2")),
    Case("tied", "PP=2", "muon+ef", "tied"),
    Case("tied", "PP=4", "adam", "tied"),
    # MTP's embedding copy on the last stage rides the tied link, untied embeddings too
    Case("mtp, untied", "PP=2", "adam", "tied", LINK_OFF),
    Case("mtp, tied", "PP=2", "adam", "measured", LINK_OFF),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_2bw_equals_its_twin(tmp_path, case):
    check(case, tmp_path)


def test_a_schedule_registered_with_its_own_generator_trains_its_lists_against_the_twin(tmp_path):
    """The registry is what runs: a schedule a test registers with 2bw's runtime and a generator of
    its own (tests/support/registered_schedule_entry.py: 2bw's deeper warm-up, other lists at 2bw's
    versions) is streamed by the runner on every rank and trains its twin's trajectory (the first
    case's twin, run once). Control: its lists are not 2bw's."""
    from megatron_async.schedules.generators import two_bw
    from tests.support.registered_schedule_entry import NAME, deep_warmup

    m = 4  # --global-batch-size / --micro-batch-size
    assert deep_warmup(2, m, 3) != two_bw(2, m, 3)
    log = tmp_path / "generator.log"
    proc, metrics = run(tmp_path, "registered", 2, two_bw_flags(2, NAME),
                        module="tests.support.registered_schedule_entry", env={"REGISTERED_SCHEDULE_LOG": str(log)})
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert sorted(line.split()[0] for line in log.read_text().splitlines()) == ["0", "1"]
    assert_same(logged_losses(metrics), shared_losses(tmp_path, 1, twin_flags(2), MODEL)[0])

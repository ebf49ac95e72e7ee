"""Tied input and output embeddings (Megatron's default) under 2bw, in Megatron's loop.

(2bw with tied embeddings and with multi-token prediction against its `--simulated-delay 1`
twin, each negative control the link turned off: tests/test_twin_matrix.py and
tests/test_twin_matrix_across_ranks.py.)

- The collective audit finds no blocking collective spanning stages with tied
  embeddings, nor with multi-token prediction on the same link; with Megatron's
  embedding all-reduce left unhooked it finds it.
- A checkpoint resume is bitwise (torch_dist and torch formats; with multi-token
  prediction too), and tied to untied or back at a resume is refused, naming both; a
  synchronous resume of a 2bw torch-format checkpoint of a tied model is refused.
- The link's first contact is one matched exchange on its own group.
"""

import pytest

from test_megatron_loop import RESUME, _audit

from tests.support import loop_runs
from tests.support.loop_runs import assert_same, logged_losses, losses, run
from tests.support.twins import FEATURES, TIED

PP2 = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw"]


@pytest.fixture
def tied(monkeypatch):
    """The shared model flags without --untie-embeddings-and-output-weights."""
    monkeypatch.setattr(loop_runs, "MODEL", TIED)


def _mtp_model(tied_embeddings: bool) -> list:
    return FEATURES["mtp, tied" if tied_embeddings else "mtp, untied"][0]


def test_tied_2bw_has_no_blocking_collective_across_stages(tmp_path, tied, monkeypatch):
    crossing, _ = _audit(tmp_path, 2, PP2)
    assert not crossing, crossing[:10]
    monkeypatch.setattr(loop_runs, "MODEL", _mtp_model(True))  # multi-token prediction on the same link
    crossing, _ = _audit(tmp_path, 2, PP2)
    assert not crossing, crossing[:10]
    monkeypatch.setattr(loop_runs, "MODEL", TIED)
    # negative control: Megatron's own embedding all-reduce (first + last stage) is what the hook removes
    monkeypatch.setenv("MEGATRON_ASYNC_AUDIT_UNHOOK", "_allreduce_word_embedding_grads")
    crossing, _ = _audit(tmp_path, 2, PP2)
    assert any(name == "all_reduce" for _rank, name, *_ in crossing), crossing[:10]


FORMATS = {"torch_dist": RESUME, "torch": [a for a in RESUME if a != "torch_dist" and a != "--ckpt-format"]
           + ["--ckpt-format", "torch"]}


def _resume_equals_uninterrupted(tmp_path, base, ranks=2):
    """Saved at 4 (exit there), resumed to 8: the losses equal the uninterrupted run's. At a
    constant learning rate: a decay to 0 over the run would hide differences in its last steps."""
    base = base + ["--lr-decay-style", "constant"]
    full = losses(tmp_path, "full", ranks, base)
    ckpt = str(tmp_path / "ckpt")
    proc, first = run(tmp_path, "first", ranks, base + ["--save", ckpt, "--save-interval", "4",
                                                        "--exit-interval", "4"])
    assert proc.returncode == 0, proc.stdout[-4000:]
    proc, second = run(tmp_path, "second", ranks, base + ["--load", ckpt])
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert_same(logged_losses(first, second), full)


@pytest.mark.parametrize("ckpt_format", list(FORMATS))
def test_tied_resume_equals_the_uninterrupted_run(tmp_path, tied, ckpt_format):
    """Saved at 4 (exit there), resumed to 8, dropout on: equal to the uninterrupted run
    (observed bitwise; allowed 1e-6, as untied)."""
    _resume_equals_uninterrupted(tmp_path, FORMATS[ckpt_format] + PP2)


@pytest.mark.parametrize("saved_untied", [False, True], ids=["tied->untied", "untied->tied"])
def test_switching_the_tie_at_a_resume_is_refused(tmp_path, tied, saved_untied):
    untie = ["--untie-embeddings-and-output-weights"]
    ckpt = str(tmp_path / "ckpt")
    save = ["--save", ckpt, "--save-interval", "2", "--exit-interval", "2"]
    proc, _ = run(tmp_path, "first", 2, RESUME + PP2 + save + (untie if saved_untied else []))
    assert proc.returncode == 0, proc.stdout[-4000:]
    proc, _ = run(tmp_path, "second", 2, RESUME + PP2 + ["--load", ckpt] + ([] if saved_untied else untie))
    assert proc.returncode != 0
    assert "--untie-embeddings-and-output-weights" in proc.stdout and "tied input and output" in proc.stdout, \
        proc.stdout[-3000:]
    assert "iteration        1/" not in proc.stdout  # stopped before training


@pytest.mark.parametrize("tied_embeddings, ckpt_format, stages", [(False, "torch_dist", 2), (True, "torch", 2),
                                                                    (True, "torch", 4)],
                         ids=["untied-torch_dist", "tied-torch", "tied-torch-PP4"])
def test_multi_token_prediction_resume_equals_the_uninterrupted_run(tmp_path, monkeypatch, tied_embeddings,
                                                                    ckpt_format, stages):
    """(Tied embeddings with MTP at PP > 1 cannot be saved as torch_dist by Megatron-Core
    0.19.2 itself, 1F1B too: refused before training, tests/test_refusals.py.) Tied, the
    resumed run once hooked its first forward where the uninterrupted run did not, and
    drifted by round-off from the third iteration after the resume."""
    monkeypatch.setattr(loop_runs, "MODEL", _mtp_model(tied_embeddings))
    _resume_equals_uninterrupted(tmp_path, FORMATS[ckpt_format] + ["--pipeline-model-parallel-size", str(stages),
                                                                   "--pipeline-schedule", "2bw"], ranks=stages)


def test_a_2bw_torch_checkpoint_of_a_tied_model_is_refused_by_a_synchronous_resume(tmp_path, tied):
    """Its last stage's optimizer state of the embedding copy followed discarded updates;
    1F1B would step from it. Control: the same in torch_dist (one copy saved) resumes."""
    for ckpt_format, refused in (("torch", True), ("torch_dist", False)):
        ckpt = str(tmp_path / ckpt_format)
        base = FORMATS[ckpt_format] + ["--pipeline-model-parallel-size", "2"]
        proc, _ = run(tmp_path, f"{ckpt_format}_2bw", 2, base + ["--pipeline-schedule", "2bw", "--save", ckpt,
                                                                 "--save-interval", "2", "--exit-interval", "2"])
        assert proc.returncode == 0, proc.stdout[-4000:]
        proc, _ = run(tmp_path, f"{ckpt_format}_1f1b", 2, base + ["--load", ckpt])
        assert (proc.returncode != 0) == refused, proc.stdout[-4000:]
        assert ("a synchronous schedule would step from it" in proc.stdout) == refused, proc.stdout[-3000:]


def _pair_group_entry(rank, world_size):
    """The tied link on a PP=4 pipeline, every point-to-point operation and all-reduce
    recorded while its group is made and its ends connect: the first contact is one
    matched exchange each way on the link's own group (first: send, receive; last:
    receive, send), and no collective makes a communicator nothing uses."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_async.pipeline import p2p
    from megatron_async.pipeline.tied_embeddings import TiedEmbeddings
    from megatron_async.planning.parallel import init_model_parallel

    init_model_parallel(pipeline_model_parallel_size=4)
    seen = []
    originals = {name: getattr(dist, name) for name in ("all_reduce", "isend", "irecv")}

    def recording(name):
        def op(tensor, *args, group=None, **kwargs):
            seen.append((name, None if group is None else dist.get_process_group_ranks(group)))
            return originals[name](tensor, *args, group=group, **kwargs)
        return op

    for name in originals:
        setattr(dist, name, recording(name))
    try:
        group = p2p.first_last_group(parallel_state.get_pipeline_model_parallel_group())
        if group is not None:
            weight = torch.zeros(3)
            TiedEmbeddings(weight, weight, group, 3 if rank == 0 else 0, rank == 0).connect()
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return (None if group is None else dist.get_process_group_ranks(group)), seen


def test_the_tied_links_first_contact_is_a_matched_exchange_on_its_own_group():
    from tests.support.multiprocess import run_distributed

    results = run_distributed(_pair_group_entry, 4)
    assert [r[0] for r in results] == [[0, 3], None, None, [0, 3]]
    assert [r[1] for r in results] == [[("isend", [0, 3]), ("irecv", [0, 3])], [], [],
                                       [("irecv", [0, 3]), ("isend", [0, 3])]]

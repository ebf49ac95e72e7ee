"""bench/gpu/allocation_peak.py takes a GPU run's memory peak apart from torch's allocator
trace; these replay hand-made traces whose peak and live blocks are known by construction."""

from bench.gpu.allocation_peak import MIB, breakdown, replay, site

ATTN = [{"filename": "/x/megatron/core/transformer/dot_product_attention.py", "line": 10, "name": "forward"},
        {"filename": "/x/torch/nn/modules/module.py", "line": 1, "name": "_call_impl"}]
MLP = [{"filename": "/x/torch/nn/functional.py", "line": 3, "name": "linear"},
       {"filename": "/x/megatron/core/transformer/moe/experts.py", "line": 20, "name": "forward"}]


def alloc(addr, mib, frames):
    return {"action": "alloc", "addr": addr, "size": int(mib * MIB), "frames": frames}


def free(addr, mib):
    return {"action": "free_requested", "addr": addr, "size": int(mib * MIB)}


def trace():
    # 512 + 64 + 64 alive at event 3 (640 MiB); then the score block goes, 128 more come (384)
    return [alloc(1, 512, ATTN), alloc(2, 64, MLP), alloc(3, 64, MLP), free(1, 512), alloc(4, 128, []),
            {"action": "free_completed", "addr": 1, "size": int(512 * MIB)}]


def test_the_peak_is_the_largest_running_total_and_its_live_blocks_are_grouped_by_site():
    peak, at = replay(trace())
    assert (peak / MIB, at) == (640, 2)
    b = breakdown(trace(), base_bytes=1000 * MIB)
    assert b["peak_mib"] == 1640 and b["live_blocks"] == 3
    sizes = {g["site"]: (g["mib"], g["blocks"]) for g in b["groups"]}
    assert sizes[site(ATTN)] == (512, 1) and sizes[site(MLP)] == (128, 2)
    assert "experts.py:20" in site(MLP) and "functional.py" not in site(MLP)  # Megatron's frame, not torch's
    assert b["peak_event_site"] == site(MLP, depth=8)


def test_a_block_from_before_the_trace_lowers_the_total_when_freed():
    # a pre-existing 256 MiB block freed first: a later 200 MiB stays below the start
    events = [free(99, 256), alloc(1, 200, MLP), alloc(2, 100, MLP)]
    peak, at = replay(events)
    assert (peak / MIB, at) == (44, 2)
    assert replay([alloc(1, 200, MLP), free(99, 256), alloc(2, 100, MLP)])[0] / MIB == 200  # negative control: order


def test_allocations_without_a_python_frame_are_named_as_such():
    assert "autograd" in site([])


def test_an_address_allocated_twice_counts_once():
    # a wrapped trace can show an alloc whose free it lost: the block is not counted twice
    assert replay([alloc(1, 100, MLP), alloc(1, 100, MLP), alloc(2, 10, MLP)])[0] / MIB == 110


def test_the_moe_stage_keeps_its_microbatches_under_a_shape_override_and_refuses_its_own_flags(tmp_path):
    import pytest

    from bench.gpu.moe_stage_memory import Flags, config_flags, stage_flags

    config = config_flags()
    kw = dict(iters=4, microbatches=8, vocab=1024, tiny=False, mode="selective", metrics=tmp_path / "m.jsonl")
    flags = Flags(stage_flags(config, 7, overrides=("--micro-batch-size=2", "--seq-length=2048"), **kw))
    assert (flags.value("--micro-batch-size"), flags.value("--global-batch-size"), flags.value("--seq-length")) \
        == ("2", "16", "2048")
    assert flags.value("--recompute-granularity") == "selective"
    # the config's EP overlap has no all-to-all in the one-GPU fold (EP=1), which Megatron refuses
    assert "--overlap-moe-expert-parallel-comm" in config and "--overlap-moe-expert-parallel-comm" not in flags.argv()
    with pytest.raises(SystemExit, match="--recompute-granularity"):
        stage_flags(config, 7, overrides=("--recompute-granularity=full",), **kw)

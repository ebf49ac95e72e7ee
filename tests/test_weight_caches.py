"""2bw with Transformer-Engine-like kernels that keep per-batch weight state.

Each kind of the TE-like stand-in (tests/support/te_like.py) is installed
on every local linear layer; 2bw at PP=2 (and PP=4) is compared with its
one-step-delay twin (PP=1, simulated_delay=1, same options), which runs a whole
batch at one weight version and so is right whatever the kernel caches.
Tolerance as in test_two_bw.py: fp32 on CPU, same reductions, observed bitwise;
allowed 1e-6. Each equivalence has a negative control where the same comparison
fails: the silent error that the runtime's measure removes.
"""

import re

import pytest

from tests.support.multiprocess import RankError, run_distributed, shared_run
from tests.support.tiny_gpt import TinyGPT, train_entry
from tests.support.trajectory import assert_same_trajectory

STEPS = 8
COMMON = dict(init_by_name=True, clip_grad=0.0, num_layers=4, global_batch_size=8, micro_batch_size=2)
RTOL = ATOL = 1e-6
FUSED = dict(te_like="fused_wgrad", gradient_accumulation_fusion=True)


def _raised(failure, error: str) -> str:
    """The message of `error` in a failed rank's traceback (not the traceback's source lines)."""
    found = re.search(rf"^\S*\b{error}: (.*)$", str(failure.value), re.MULTILINE)
    assert found, f"no {error} in:\n{str(failure.value)[-2000:]}"
    return found.group(1)


def _twin(**options):
    (ref,) = shared_run(train_entry, 1, TinyGPT(simulated_delay=1, **COMMON, **options), STEPS)
    return ref


def _two_bw(pp, entry=train_entry, **options):
    return shared_run(entry, pp, TinyGPT(pp=pp, schedule="2bw", **COMMON, **options), STEPS)


# --- rank-side variants (module level, so they pickle) ------------------------------

def _train_with_stage0_first_backward_late(rank, world_size, spec, steps):
    """Stage 0 runs each batch's first backward right after its second one. Stage 0's
    backwards send nothing, so any order of them is a valid schedule; only a kernel
    that treats "the first microbatch's backward" specially can tell."""
    from megatron_async.schedules import stream_2bw
    from megatron_async.schedules.actions import Backward

    actions = stream_2bw.TwoBWStream.actions

    def reordered(self, stage):
        held = None
        for action in actions(self, stage):
            if stage == 0 and isinstance(action, Backward) and action.microbatch % self.m == 0:
                held = action
                continue
            yield action
            if held is not None and isinstance(action, Backward) and action.microbatch == held.microbatch + 1:
                yield held
                held = None

    stream_2bw.TwoBWStream.actions = reordered
    return train_entry(rank, world_size, spec, steps)


CACHE_WITHOUT_SWITCH = "decoder.layers.0.mlp.linear_fc1"


def _train_with_a_cache_without_switch(rank, world_size, spec, steps):
    """One layer takes `is_first_microbatch` but offers no switch to turn its cache off."""
    from tests.support import te_like

    install = te_like.install

    def install_leaving_one_without_switch(model, kind, honour_switch=True):
        names = install(model, kind, honour_switch)
        for chunk in model:
            for name, module in chunk.named_modules():
                if name.endswith(CACHE_WITHOUT_SWITCH):
                    delattr(module, te_like.SWITCH)
        return names

    te_like.install = install_leaving_one_without_switch
    return train_entry(rank, world_size, spec, steps)


# --- fp8-like weight cache ------------------------------------------------------------

@pytest.mark.parametrize("pp", [2, 4])
def test_fp8_weight_cache_equals_the_twin_once_2bw_turns_it_off(pp):
    options = dict(te_like="fp8_cache")
    assert_same_trajectory(_twin(**options), _two_bw(pp, **options), RTOL, ATOL)


def test_fp8_weight_cache_left_on_gives_another_trajectory():
    """Negative control: a kernel that ignores the switch refreshes its cache at the next
    batch's first forward, before the previous batch's last backwards read it."""
    options = dict(te_like="fp8_cache", te_like_honours_switch=False)
    twin = _twin(**options)
    with pytest.raises(AssertionError):
        assert_same_trajectory(twin, _two_bw(2, **options), RTOL, ATOL)


def test_a_weight_cache_without_a_switch_is_refused_by_name():
    with pytest.raises(RankError) as failure:
        _two_bw(2, entry=_train_with_a_cache_without_switch, te_like="fp8_cache")
    assert f"'{CACHE_WITHOUT_SWITCH}'" in _raised(failure, "WeightCacheError")


# --- fused weight-gradient accumulation (overwrite on the first microbatch) -----------

@pytest.mark.parametrize("pp", [2, 4])
def test_fused_wgrad_accumulation_equals_the_twin(pp):
    assert_same_trajectory(_twin(**FUSED), _two_bw(pp, **FUSED), RTOL, ATOL)


def test_fused_wgrad_overwrite_rule_is_harmless_in_2bws_backward_order():
    """With the overwrite rule live (the kernel ignores the switch), 2bw still equals the
    twin: each batch's first backward is the first after the previous step zeroed
    main_grad, so overwriting equals adding."""
    options = {**FUSED, "te_like_honours_switch": False}
    assert_same_trajectory(_twin(**options), _two_bw(2, **options), RTOL, ATOL)


def test_fused_wgrad_overwrite_rule_breaks_when_the_first_backward_is_not_first():
    """Negative control: with stage 0's first backward of each batch moved after its
    second, the overwrite drops the second's gradient; with the switch honoured (always
    adding) the same order still equals the twin, so the overwrite is the cause."""
    twin = _twin(**FUSED)
    overwriting = _two_bw(2, entry=_train_with_stage0_first_backward_late, te_like_honours_switch=False, **FUSED)
    with pytest.raises(AssertionError):
        assert_same_trajectory(twin, overwriting, RTOL, ATOL)
    adding = _two_bw(2, entry=_train_with_stage0_first_backward_late, **FUSED)
    assert_same_trajectory(twin, adding, RTOL, ATOL)


# --- a kernel that saves its own alias of the weight ----------------------------------

def test_a_saved_alias_of_a_weight_is_refused_by_name():
    with pytest.raises(RankError) as failure:
        _two_bw(2, te_like="alias")
    # every linear layer saves an alias; the first one run on either stage is refused
    assert "'decoder.layers.0.self_attention.linear_qkv.weight'" in _raised(failure, "StashAliasError")


def test_a_saved_alias_is_harmless_and_accepted_without_2bws_interleaving():
    """The simulated-delay twin runs each batch between two steps: an alias is read
    before any step changes it, so the guard (on by default) has nothing to refuse."""
    twin = _twin(te_like="alias")  # the guard is on: it must not raise
    assert len(twin["losses"]) == STEPS


def test_a_saved_alias_of_a_weight_unguarded_trains_another_trajectory():
    """Negative control: without the guard the run trains silently, to a wrong trajectory
    (the warm-up forwards' backwards read the weights the step just wrote)."""
    options = dict(te_like="alias", stash_alias_guard=False)
    twin = _twin(**options)
    with pytest.raises(AssertionError):
        assert_same_trajectory(twin, _two_bw(2, **options), RTOL, ATOL)


# --- the stand-in's own guards ----------------------------------------------------------

def test_te_like_refuses_an_unknown_kind():
    from tests.support import te_like

    with pytest.raises(ValueError, match="fp8_cache"):
        te_like.install([], "fp4_cache")


def _build_only(rank, world_size, spec):
    from tests.support.tiny_gpt import build

    build(spec)


def test_te_like_refuses_tensor_parallel_layers():
    """Its kernel has no tensor-parallel communication: at TP=2 it would be silently wrong."""
    with pytest.raises(RankError) as failure:
        run_distributed(_build_only, 2, TinyGPT(tp=2, te_like="alias"))
    assert "is tensor-parallel" in _raised(failure, "ValueError")

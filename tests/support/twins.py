"""2bw against its `--simulated-delay` twin in Megatron's loop: the matrix's dimensions and its check.

The twin trains at PP=1 with the delay of a P-stage pipeline (`--simulated-delay 1
--simulated-pipeline-stages P`): each gradient at the weights of one step earlier, as 2bw at
PP=P takes it, through Megatron's own no-pipelining schedule. So every part of Megatron's
per-microbatch step (loss normalisation, the MoE auxiliary-loss scale, the sequence-parallel
all-reduce, recompute) is the reference, and 2bw must give the same loss at every iteration.

A case is (feature, layout, optimizer) with a tolerance class, each with its reason, and an
optional negative control. A training run is deterministic (fixed seeds, gloo, the mock
data), so a run with the same flags repeats the one before: `shared_losses` trains each once
per pytest process (a module's tests stay on one xdist worker, --dist loadscope), for the
twins and controls several cases compare against. Only for comparisons between different
flags: a test that checks a run against a rerun of itself must run both.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tests.support.loop_runs import ITERS, LAUNCH, MODEL, RTOL, assert_same, losses, records

UNTIE = "--untie-embeddings-and-output-weights"
TIED = [a for a in MODEL if a != UNTIE]
# (biases off, as in Megatron-LM's MoE examples: with expert biases and no tensor or expert
# parallelism, megatron-core 0.19.2's local expert adds the bias in place on a view autograd forbids)
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01",
       "--moe-token-dispatcher-type", "alltoall", "--disable-bias-linear"]


def _rope(model: list) -> list:
    return [a if a != "learned_absolute" else "rope" for a in model]


# feature: (model flags, flags both runs add)
FEATURES = {
    "untied": (MODEL, []),
    "tied": (TIED, []),
    "rope, swiglu, rmsnorm, gqa": (_rope(MODEL), ["--swiglu", "--normalization", "RMSNorm", "--group-query-attention",
                                                  "--num-query-groups", "2", "--disable-bias-linear"]),
    "full recompute": (MODEL, ["--recompute-granularity", "full", "--recompute-method", "uniform",
                               "--recompute-num-layers", "1"]),
    "selective recompute": (MODEL, ["--recompute-granularity", "selective"]),
    "moe, aux loss": (MODEL, MOE),
    # the public recipes' flags that run on 4 CPU ranks beside the layout's (docs/megatron_lm.md,
    # 'Public recipes under 2bw'): expert parallelism with the all-to-all dispatcher, gradients reduced in bf16
    "recipes' union: moe at ep2, bf16 grads": (MODEL, MOE + ["--expert-model-parallel-size", "2", "--bf16",
                                                             "--grad-reduce-in-bf16"]),
    # Megatron's MTP embeds with RoPE; its embedding copy on the last stage rides the tied link
    "mtp, untied": (_rope(MODEL) + ["--mtp-num-layers", "1"], []),
    "mtp, tied": (_rope(TIED) + ["--mtp-num-layers", "1"], []),
}

DIST_OPT = ("--use-distributed-optimizer",)
REDUCE = ("--overlap-grad-reduce",)
REDUCE_AND_GATHER = ("--overlap-grad-reduce", "--overlap-param-gather")  # (the gather needs the reduce)


@dataclass(frozen=True)
class Layout:
    pp: int
    world: int  # 2bw's ranks; the twin has world // pp
    both: tuple = ()  # flags of both runs
    twin: tuple = ()  # of the twin only
    two_bw: tuple = ()  # of 2bw only


# The data-parallel twins take both overlaps whatever 2bw overlaps: an overlap changes when a
# reduction or gather runs, not what it computes, so one twin serves the three 2bw runs of a row.
LAYOUTS = {
    "PP=2": Layout(2, 2),
    "PP=4": Layout(4, 4),
    "PP=2 x DP=2, dist-opt": Layout(2, 4, DIST_OPT, REDUCE_AND_GATHER),
    "PP=2 x DP=2, dist-opt, overlapped reduce": Layout(2, 4, DIST_OPT, REDUCE_AND_GATHER, REDUCE),
    "PP=2 x DP=2, dist-opt, overlapped reduce and gather": Layout(2, 4, DIST_OPT, REDUCE_AND_GATHER, REDUCE_AND_GATHER),
    "PP=2 x TP=2": Layout(2, 4, ("--tensor-model-parallel-size", "2")),
    "PP=2 x TP=2, sequence parallel": Layout(2, 4, ("--tensor-model-parallel-size", "2", "--sequence-parallel")),
    "PP=2 x EP=2": Layout(2, 4, ("--expert-model-parallel-size", "2")),
}

EF = ["--delay-correction", "ef"]
OPTIMIZERS = {
    "adam": [],
    "adam+ef": EF,
    "muon": ["--optimizer", "muon"],
    "muon+ef": ["--optimizer", "muon", *EF],
    # Megatron's layer-wise optimizer drives its per-rank optimizers only with --bf16
    "muon+ef, layer-wise, bf16": ["--optimizer", "muon", *EF, "--bf16"],
}

# tolerance class: (relative tolerance, why); None: measured by the case itself
TOLERANCES = {
    "fp32": (RTOL, "fp32 on the CPU: a pipeline changes no reduction order inside a layer (observed bitwise)"),
    "split": (1e-5, "tensor or expert parallelism splits reductions otherwise across the two layouts' ranks"),
    "tied": (1e-5, "both pipelines add the tied gradient's two parts after the backward, the twin inside it: "
                   "another summation order; Megatron's own 1F1B at PP=2 is up to 7e-6 from PP=1 with Muon"),
    "bf16": (1e-4, "bf16 rounds differently at PP=1 and PP=2: the same runs without the overlaps differ by up "
                   "to 3e-5"),
    "measured": (None, "tied MTP: the MTP block, the output layer and the embeddings share one weight, and "
                       "Megatron's own 1F1B at PP=2 is already about 6e-5 from PP=1: twice that gap, measured"),
}
SYNC, LINK_OFF = "synchronous", "link off"
# a negative control: a run the case's comparison must tell from the twin
CONTROLS = {
    # the delay is visible at the class's tolerance (one such control per class)
    SYNC: "synchronous training at the twin's layout is another trajectory",
    # tests/support/untied_copy.py: an equivalence that cannot tell this run from the twin cannot see the link
    LINK_OFF: "2bw with the tied link turned off, the last stage training its own copy, is another trajectory",
}


@dataclass(frozen=True)
class Case:
    feature: str
    layout: str
    optimizer: str
    tolerance: str
    control: str | None = None
    both: tuple = ()  # what else both runs add

    @property
    def id(self) -> str:
        return f"{self.feature} | {self.layout} | {self.optimizer}"

    def model(self) -> list:
        return list(FEATURES[self.feature][0])

    def common(self) -> list:
        layout = LAYOUTS[self.layout]
        return [*FEATURES[self.feature][1], *layout.both, *OPTIMIZERS[self.optimizer], *self.both]

    def sync_run(self) -> tuple[int, list]:
        """The twin's ranks and flags without the delay."""
        layout = LAYOUTS[self.layout]
        return layout.world // layout.pp, [*self.common(), *layout.twin]

    def twin_run(self) -> tuple[int, list]:
        ranks, flags = self.sync_run()
        return ranks, flags + twin_flags(LAYOUTS[self.layout].pp)

    def two_bw_run(self) -> tuple[int, list]:
        layout = LAYOUTS[self.layout]
        return layout.world, [*self.common(), *layout.two_bw, *two_bw_flags(layout.pp)]


def twin_flags(pp: int) -> list:
    return ["--simulated-delay", "1", "--simulated-pipeline-stages", str(pp)]


def two_bw_flags(pp: int, schedule: str = "2bw") -> list:
    return ["--pipeline-model-parallel-size", str(pp), "--pipeline-schedule", schedule]


_SHARED: dict = {}


def shared_losses(tmp_path, nproc: int, extra: list, model: list, module: str = LAUNCH) -> tuple[list, list]:
    """(training losses, validation losses during training) of a run that must log ITERS finite
    training losses, trained once per process for the same flags; each caller gets its own lists."""
    key = (module, nproc, tuple(model), tuple(extra))
    if key not in _SHARED:
        name = f"shared{len(_SHARED)}"
        train = losses(tmp_path, name, nproc, extra, module=module, model=model)
        val = [r["val_loss"] for r in records(tmp_path / f"{name}.jsonl") if r.get("val_loss") is not None]
        _SHARED[key] = train, val
    return tuple(list(found) for found in _SHARED[key])


def check(case: Case, tmp_path) -> None:
    """2bw's losses within the case's tolerance of its twin's (and its validation losses,
    where the case evaluates during training), then the case's negative control."""
    model = case.model()
    twin, twin_val = shared_losses(tmp_path, *case.twin_run(), model)
    two_bw, two_bw_val = shared_losses(tmp_path, *case.two_bw_run(), model)
    rtol, why = TOLERANCES[case.tolerance]
    if rtol is None:  # Megatron's own pipelining moves this model by round-off already: measure it
        ranks, flags = case.sync_run()
        layout = LAYOUTS[case.layout]
        one, _ = shared_losses(tmp_path, ranks, flags, model)
        pipelined, _ = shared_losses(tmp_path, layout.world, flags + ["--pipeline-model-parallel-size", str(layout.pp)],
                                     model)
        rtol = max(TOLERANCES["tied"][0], 2 * max(abs(x - y) / abs(y) for x, y in zip(pipelined, one)))
    try:
        assert_same(two_bw, twin, rtol)
        if "--eval-interval" in case.both:  # it evaluates during training, at the newest weights: those too
            assert len(twin_val) >= ITERS // int(case.both[case.both.index("--eval-interval") + 1]), twin_val
            assert len(two_bw_val) == len(twin_val), (two_bw_val, twin_val)
            assert_same(two_bw_val, twin_val, rtol)
    except AssertionError as error:
        raise AssertionError(f"{error}; the {case.tolerance} class allows {rtol:g}: {why}") from None
    if case.control is None:
        return
    if case.control == SYNC:
        other, _ = shared_losses(tmp_path, *case.sync_run(), model)
    else:
        other, _ = shared_losses(tmp_path, *case.two_bw_run(), model, module="tests.support.untied_copy")
    try:
        assert_same(other, twin, rtol)
    except AssertionError:
        return
    pytest.fail(f"negative control within {rtol:g} of the twin: {CONTROLS[case.control]}, which the comparison "
                "must tell apart")

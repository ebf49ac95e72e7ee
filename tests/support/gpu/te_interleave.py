"""2bw's interleaving, driven by hand through real Transformer Engine modules on one GPU.

    python -m tests.support.gpu.te_interleave CASE OUT.json    # CASE: bf16 | fp8 | fp8-cached

Under 2bw a microbatch A of batch t+1 runs its forward at version v before the
optimizer step, the next batch's first microbatch then runs at v+1 (Megatron
raises `is_first_microbatch` there, which refreshes TE's cached fp8 weights in
place), and only then does A's backward run, at v. This module plays exactly
that order on a TE stage (tests/support/gpu/te_stage.py) with the weight stash, then computes
A's gradients again the plain way: the same modules loaded with v's weights,
forward and backward back to back, no stash, no cache, and with the fp8 scales
the interleaved run used for each microbatch. It writes relative errors
(||a - b|| / ||b||, the largest over tensors) for the suite to judge:

- `A0.input`, `A1.input`, `A0.main_grad`: each microbatch's input gradient and
  the weight gradients in DDP's `main_grad` (fused accumulation), interleaved
  against the reference;
- `batch.main_grad`: `main_grad` after both microbatches of the batch against
  the sum of their reference gradients (fused accumulation must add);
- controls, the same metrics against what a broken run would give:
  `accumulation_control` against the second microbatch's gradient alone (as if
  its backward overwrote `main_grad`), `version_control` against A0's gradients
  at v+1 (as if the backward read the newest weights).

Cases: bf16 and fp8 with `disable_first_microbatch_caches` applied (what
TwoBWRunner does), and fp8-cached without it, where A's backward is expected to
read the fp8 weights the next batch refreshed.
"""

from __future__ import annotations

import json
import sys
from contextlib import nullcontext

import torch

CASES = {"bf16": (False, True), "fp8": (True, True), "fp8-cached": (True, False)}  # (fp8, caches disabled)
STEP_SCALE = 0.5  # the hand-made optimizer step moves each weight by about half its mean magnitude


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _max_rel(pairs) -> float:
    return max(rel_err(a, b) for a, b in pairs)


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_(True)


class _Run:
    def __init__(self, fp8: bool, disable_caches: bool, seed: int = 1234):
        from megatron_async.pipeline.weight_caches import disable_first_microbatch_caches
        from megatron_async.stash.weight_stash import WeightStashManager
        from tests.support.gpu.te_stage import HIDDEN, TOKENS, build_stage

        self.model, self.config = build_stage(fp8)
        self.stash = WeightStashManager([self.model], depth=1, guard_aliases=True)
        self.switched = disable_first_microbatch_caches([self.model]) if disable_caches else 0
        gen = torch.Generator(device="cuda").manual_seed(seed)

        def draw(*shape, scale=1.0):
            return (torch.randn(shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)

        self.warm = [(draw(TOKENS, HIDDEN), draw(TOKENS, HIDDEN, scale=0.1)) for _ in range(2)]
        self.batch = [(draw(TOKENS, HIDDEN), draw(TOKENS, HIDDEN, scale=0.1)) for _ in range(2)]  # A0, A1
        self.next_first = draw(TOKENS, HIDDEN)  # B0: the next batch's first microbatch
        self.deltas = [(torch.randn(p.shape, generator=gen, device="cuda") * STEP_SCALE
                        * p.detach().float().abs().mean().clamp_min(1e-2)).to(p.dtype) for p in self.stash.params]
        names = {id(p): n for n, p in self.model.named_parameters()}
        self.names = [names.get(id(p), f"#{i}") for i, p in enumerate(self.stash.params)]

    def forward(self, x: torch.Tensor, first: bool) -> torch.Tensor:
        from tests.support.gpu.te_stage import fp8_context

        if first:  # what Megatron's forward_step does for a batch's first microbatch
            self.model.set_is_first_microbatch()
        with fp8_context(self.config):
            return self.model(x)

    def main_grads(self) -> list[torch.Tensor]:
        return [p.main_grad.detach().clone() for p in self.stash.params]

    @torch.no_grad()
    def load_live(self, weights: list[torch.Tensor]) -> None:
        self.stash.point_to(self.stash.newest)
        for p, w in zip(self.stash.params, weights):
            p.data.copy_(w)

    def interleaved(self) -> dict:
        """Warm-up batch, A0 and A1 forward at v, step, B0 forward at v+1, A0 and A1 backward at v."""
        from tests.support.gpu.te_stage import snapshot_fp8_meta

        stash, model = self.stash, self.model
        for k, (x, dy) in enumerate(self.warm):  # fp8 scales from a real amax history, caches allocated
            with stash.use(0, hooks=True):
                out = self.forward(_leaf(x), first=k == 0)
            with stash.use(0, hooks=True):
                out.backward(dy)
        model.zero_grad_buffer()
        self.w_v = [p.detach().clone() for p in stash.params]
        fwd_meta, outs, inputs = [], [], []
        for k, (x, _dy) in enumerate(self.batch):
            fwd_meta.append(snapshot_fp8_meta(model))
            inputs.append(_leaf(x))
            with stash.use(0, hooks=True):
                outs.append(self.forward(inputs[-1], first=k == 0))
        with stash.optimizer_step(), torch.no_grad():  # the live weights become version 1
            for p, d in zip(stash.params, self.deltas):
                p.data.add_(d)
        model.zero_grad_buffer()
        self.w_next = [p.detach().clone() for p in stash.params]
        with stash.use(1, hooks=True):
            out_next = self.forward(_leaf(self.next_first), first=True)
        del out_next
        bwd_meta, grads = [], []
        for k, (_x, dy) in enumerate(self.batch):
            bwd_meta.append(snapshot_fp8_meta(model))
            sync = model.no_sync() if k < len(self.batch) - 1 else nullcontext()
            with sync, stash.use(0, hooks=True):
                outs[k].backward(dy)
            grads.append(self.main_grads())
        torch.cuda.synchronize()
        return {"inputs": [x.grad.detach().clone() for x in inputs], "grads": grads,
                "fwd_meta": fwd_meta, "bwd_meta": bwd_meta}

    def reference(self, weights, k: int, fwd_meta: dict, bwd_meta: dict) -> tuple[torch.Tensor, list]:
        """Microbatch k alone at `weights`: no stash, no cache, the scales its interleaved run used."""
        from megatron_async.pipeline.weight_caches import SWITCH
        from tests.support.gpu.te_stage import restore_fp8_meta

        for module in self.model.modules():
            if hasattr(module, SWITCH):
                setattr(module, SWITCH, True)
        self.load_live(weights)
        restore_fp8_meta(self.model, fwd_meta, keys=("scaling_fwd",))
        restore_fp8_meta(self.model, bwd_meta, keys=("scaling_bwd",))
        self.model.zero_grad_buffer()
        x, dy = self.batch[k]
        x = _leaf(x)
        self.forward(x, first=True).backward(dy)
        torch.cuda.synchronize()
        return x.grad.detach().clone(), self.main_grads()


def measure(fp8: bool, disable_caches: bool) -> dict:
    """The interleaved run, its references and the relative errors (process group already up)."""
    r = _Run(fp8, disable_caches)
    got = r.interleaved()
    refs = [r.reference(r.w_v, k, got["fwd_meta"][k], got["bwd_meta"][k]) for k in range(2)]
    next_input, next_grads = r.reference(r.w_next, 0, got["fwd_meta"][0], got["bwd_meta"][0])
    batch_sum = [a + b for a, b in zip(refs[0][1], refs[1][1])]
    per_param = {name: {"A0": rel_err(g, ref), "batch": rel_err(b, s)}
                 for name, g, ref, b, s in zip(r.names, got["grads"][0], refs[0][1], got["grads"][1], batch_sum)}
    finite = all(bool(torch.isfinite(t).all()) for t in [*got["inputs"], *got["grads"][1]])
    errors = {
        "A0.input": rel_err(got["inputs"][0], refs[0][0]),
        "A1.input": rel_err(got["inputs"][1], refs[1][0]),
        "A0.main_grad": _max_rel(zip(got["grads"][0], refs[0][1])),
        "batch.main_grad": _max_rel(zip(got["grads"][1], batch_sum)),
        "accumulation_control": _max_rel(zip(got["grads"][1], refs[1][1])),
        "version_control": max(rel_err(got["inputs"][0], next_input), _max_rel(zip(got["grads"][0], next_grads))),
    }
    return {"fp8": fp8, "caches_disabled": disable_caches, "switched_modules": r.switched,
            "parameters": len(r.names), "finite": finite, "errors": errors, "per_param": per_param}


def run(case: str) -> dict:
    from tests.support.gpu.env import describe
    from tests.support.gpu.te_stage import init_single_rank_nccl

    init_single_rank_nccl()
    result = {"case": case, **measure(*CASES[case])}
    env = describe()
    torch.distributed.destroy_process_group()
    return {**result, "te_version": env.get("te_version"), "device": env.get("device")}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] not in CASES:
        print(__doc__)
        return 2
    result = run(argv[0])
    with open(argv[1], "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["errors"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

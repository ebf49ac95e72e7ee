"""Corrections of the one-step-delayed update around any Megatron optimizer.

Under 2bw (and `--simulated-delay 1`) step t applies an update D_t computed from a
gradient taken at weights one step old. Three corrections act at the optimizer step
(docs/delay_correction.md):

- `ef` (error feedback) applies U_t = D_t + lambda * (D_t - D_{t-1}), a first-order
  extrapolation of the update sequence to the step the gradient missed;
- `dc-asgd` (delay compensation, Zheng et al. 2017, adaptive variant) corrects the
  gradient before the optimizer sees it, with the diagonal of the gradient outer
  product standing in for the Hessian: g <- g + lambda_t * g * g * (W_t - W_{t-1}),
  where W_t - W_{t-1} = D_{t-1} and lambda_t = lambda_0 / sqrt(mean square of g),
  an exponential average with rate 0.95;
- `nesterov` (Nesterov look-ahead, after Ajanthan et al. 2025) feeds the optimizer
  g~_t = g_t + beta (g_t - g_{t-1}) (g_{-1} = 0): a momentum optimizer with
  coefficient beta then keeps exactly the Nesterov look-ahead of its momentum
  (SGD becomes torch's SGD(nesterov=True)), for any optimizer whose momentum is an
  exponential or heavy-ball average of the gradients it is given.

D_t is measured, not derived: it is what the wrapped
optimizer did to its own main parameters (after momentum, orthogonalisation,
scaling, weight decay and learning rate), so any Megatron optimizer works
unchanged: Adam, Muon, a ChainedOptimizer, the distributed optimizers.

How: a pre/post step hook (torch's `register_step_pre_hook`) on every torch
optimizer inside the Megatron optimizer snapshots its parameters before the inner
step (DC-ASGD also corrects the gradients there: after Megatron's unscaling and
clipping) and, for EF, corrects them right after it. That is before Megatron copies main params
to the model params and all-gathers them, so the corrected values reach the model
through Megatron's own copy and gather: no extra communication, and the buffer of
previous updates is sharded exactly like the main parameters. On the first step
(and after a resume without EF state) there is no D_{t-1}: D_0 is applied unchanged.
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Iterator, Optional

import torch

STATE_KEY = "delay_correction"
RULES = ("ef", "dc-asgd", "nesterov")
DC_BETA = 0.95  # rate of DC-ASGD's mean square of the gradient
DC_EPS = 1e-12


def torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a Megatron optimizer (ChainedOptimizer, layer-wise, ...)."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        return [inner for child in chained for inner in torch_optimizers(child)]
    inner = getattr(optimizer, "optimizer", None)
    return [inner] if isinstance(inner, torch.optim.Optimizer) else []


def _params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


class DelayCorrection:
    """The hooks and their state: the previous update D_{t-1} of every main parameter
    (and, for DC-ASGD, the mean square of its gradient)."""

    def __init__(self, optimizer, ef_lambda: float = 1.0, rule: str = "ef", dc_lambda: float = 1.0,
                 nesterov_beta: float = 0.9):
        if rule not in RULES:
            raise ValueError(f"unknown delay correction {rule!r} (choose from {', '.join(RULES)})")
        self.rule = rule
        self.ef_lambda = float(ef_lambda)
        self.dc_lambda = float(dc_lambda)
        self.nesterov_beta = float(nesterov_beta)
        self.load_expected = True  # False: the checkpoint to resume holds no EF state (asked for nothing)
        self.steps = 0  # inner steps seen (of the first torch optimizer)
        self._enabled = False
        self._opts = torch_optimizers(optimizer)
        self._prev: list[Optional[list[torch.Tensor]]] = [None] * len(self._opts)
        self._snap: list[Optional[list[torch.Tensor]]] = [None] * len(self._opts)
        self._mean_square: list[Optional[list[torch.Tensor]]] = [None] * len(self._opts)
        self._depth = [0] * len(self._opts)
        for index, opt in enumerate(self._opts):
            opt.register_step_pre_hook(partial(self._before, index))
            opt.register_step_post_hook(partial(self._after, index))

    @contextlib.contextmanager
    def enabled(self) -> Iterator[None]:
        """Correct only steps taken inside (not e.g. Megatron's dummy state-init steps)."""
        self._enabled = True
        try:
            yield
        finally:
            self._enabled = False

    @torch.no_grad()
    def _before(self, index: int, opt, _args, _kwargs) -> None:
        if not self._enabled:
            return
        self._depth[index] += 1  # a subclass step calling a hooked base step fires twice
        if self._depth[index] != 1:
            return
        if self.rule == "nesterov":
            self._look_ahead(index, _params(opt))
            return
        self._snap[index] = [p.detach().clone() for p in _params(opt)]
        if self.rule == "dc-asgd":
            self._compensate(index, _params(opt))

    def _look_ahead(self, index: int, params: list[torch.Tensor]) -> None:
        """Nesterov: g <- g + beta (g - g_prev), g_prev the last raw gradient (zero at first)."""
        prev = self._prev[index]
        if prev is None:
            prev = [torch.zeros_like(p) for p in params]
        for i, p in enumerate(params):
            if p.grad is None:
                continue
            g = p.grad.detach()
            raw = g.clone()
            g.add_(raw - prev[i], alpha=self.nesterov_beta)
            prev[i] = raw
        self._prev[index] = prev

    def _compensate(self, index: int, params: list[torch.Tensor]) -> None:
        """DC-ASGD: g <- g + lambda_0 / sqrt(ms) * g * g * D_{t-1}, ms the mean square of g."""
        squares = self._mean_square[index]
        if squares is None:
            squares = self._mean_square[index] = [
                torch.zeros_like(p) if p.grad is None else p.grad.detach().square() for p in params]
        prev = self._prev[index]
        for i, p in enumerate(params):
            if p.grad is None:
                continue
            g = p.grad.detach()
            squares[i].mul_(DC_BETA).addcmul_(g, g, value=1 - DC_BETA)
            if prev is not None:
                g.add_(g * g * prev[i] / (squares[i].sqrt() + DC_EPS), alpha=self.dc_lambda)

    @torch.no_grad()
    def _after(self, index: int, opt, _args, _kwargs) -> None:
        if not self._enabled:
            return
        self._depth[index] -= 1
        if self._depth[index]:
            return
        if index == 0:
            self.steps += 1
        if self.rule == "nesterov":
            return
        params, snap, prev = _params(opt), self._snap[index], self._prev[index]
        self._snap[index] = None
        for i, p in enumerate(params):
            update = snap[i].neg_().add_(p.detach())  # D_t, in the snapshot's storage
            if prev is not None and self.rule == "ef":
                p.detach().add_(update - prev[i], alpha=self.ef_lambda)
        self._prev[index] = snap

    def _restore(self, saved: list) -> list:
        if len(saved) != len(self._opts):
            raise ValueError(f"delay-correction state has {len(saved)} optimizers, this run has {len(self._opts)}")
        restored = []
        for index, (opt, tensors) in enumerate(zip(self._opts, saved)):
            if tensors is None:
                restored.append(None)
                continue
            params = _params(opt)
            if [tuple(t.shape) for t in tensors] != [tuple(p.shape) for p in params]:
                raise ValueError(f"delay-correction state of optimizer {index} does not match its parameters")
            restored.append([t.to(device=p.device, dtype=p.dtype).clone() for t, p in zip(tensors, params)])
        return restored

    def buffer_bytes(self) -> int:
        """Memory held between steps: one copy of the main parameters (two for DC-ASGD)."""
        held = [*self._prev, *self._mean_square]
        return sum(t.numel() * t.element_size() for tensors in held if tensors for t in tensors)

    def state_dict(self) -> dict:
        """This rank's record (the previous update of each local main-parameter shard)."""
        def saved(buffers):
            return [None if b is None else [t.detach().to("cpu", copy=True) for t in b] for b in buffers]

        return {
            "rule": self.rule,
            "ef_lambda": self.ef_lambda,
            "dc_lambda": self.dc_lambda,
            "nesterov_beta": self.nesterov_beta,
            "steps": self.steps,
            "prev": saved(self._prev),
            "mean_square": saved(self._mean_square),
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        if state.get("rule", "ef") != self.rule:
            raise ValueError(f"the checkpoint holds the state of --delay-correction {state.get('rule', 'ef')}, "
                             f"this run asks for {self.rule}")
        self._prev = self._restore(state["prev"])
        self._mean_square = self._restore(state.get("mean_square", [None] * len(self._opts)))
        self.steps = int(state["steps"])


class DelayCorrectedOptimizer:
    """A Megatron optimizer whose steps apply a delay correction (`rule`: ef, dc-asgd, nesterov).

    Everything but `step`, `sharded_state_dict` and `load_state_dict` is the wrapped
    optimizer's (attribute reads and writes are delegated). The correction's state
    travels inside the optimizer's sharded state dict under STATE_KEY, packed by
    `checkpoint` (`add_state(sharded, key, state, is_loading, expected)` and
    `pop_state(state_dict, key, load)`: Megatron's adapter hands in its per-rank
    objects, megatron_lm/checkpoint/optimizer_state.py); without one, as a plain entry.
    """

    _OWN = ("wrapped", "delay_correction", "checkpoint")

    def __init__(self, optimizer, ef_lambda: float = 1.0, rule: str = "ef", dc_lambda: float = 1.0,
                 nesterov_beta: float = 0.9, checkpoint=None):
        object.__setattr__(self, "wrapped", optimizer)
        object.__setattr__(self, "delay_correction",
                           DelayCorrection(optimizer, ef_lambda, rule, dc_lambda, nesterov_beta))
        object.__setattr__(self, "checkpoint", checkpoint or _PlainState)

    def __getattr__(self, name):
        return getattr(self.wrapped, name)

    def __setattr__(self, name, value) -> None:
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.wrapped, name, value)

    def step(self):
        """(update_successful, grad_norm, num_zeros) of the wrapped step, with U_t applied."""
        with self.delay_correction.enabled():
            return self.wrapped.step()

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, **kwargs):
        state = self.wrapped.sharded_state_dict(model_sharded_state_dict, is_loading, **kwargs)
        return self.checkpoint.add_state(state, STATE_KEY, self.delay_correction.state_dict, is_loading,
                                         self.delay_correction.load_expected)

    def load_state_dict(self, state_dict) -> None:
        self.wrapped.load_state_dict(self.checkpoint.pop_state(state_dict, STATE_KEY,
                                                               self.delay_correction.load_state_dict))


class _PlainState:
    """The correction's state as a plain entry of the optimizer's state dict."""

    @staticmethod
    def add_state(sharded: dict, key: str, state, is_loading: bool, expected: bool = True) -> dict:
        if not is_loading or expected:
            sharded[key] = state()
        return sharded

    @staticmethod
    def pop_state(state_dict, key: str, load):
        if isinstance(state_dict, dict) and key in state_dict:
            state_dict = dict(state_dict)
            load(state_dict.pop(key))
        return state_dict



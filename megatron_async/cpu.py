"""Run Megatron-Core on a machine without CUDA by mapping its CUDA calls to the CPU.

Megatron-Core assumes CUDA everywhere: tensors are created with ``device='cuda'`` or
``torch.cuda.current_device()``, streams and events order communication, the RNG
tracker forks CUDA generator states, several asserts compare ``Tensor.type()``
against ``'torch.cuda.FloatTensor'``, and gradient-accumulation fusion (on by
default) needs apex's weight-gradient kernel. This module makes all of that run on
the CPU (with the gloo backend), so GPTModel, DDP, the distributed optimizer, MoE
and the pipeline schedules work in CPU smoke runs and CI.

It is activated explicitly (``activate()``, ``--device cpu``) or by ``auto`` when CUDA
is absent, and refuses to activate when CUDA is present: nothing here ever changes a
GPU run. Each patch is an entry of a table (`tables()`, megatron_async/patch_table.py) that
names the code calling it; `deactivate()` undoes them all.

Shipped in the wheel because user-facing commands need it on a machine without CUDA,
where they call ``setup_device("auto")``: the launcher (``python -m megatron_async.launch``,
``megatron-async-pretrain``), which ``make demo`` (examples/demo.sh: 2bw on two CPU
processes) and the CI smoke inside the image (``make image-smoke``: docker/image.sh runs
the same script in the image) run, as do the local Slurm cluster's CPU ranks
(examples/slurm/rank_command.sh, ``make test-cluster``); and the command-line check
(``megatron_async.check_flags``) and the planner (``megatron_async.planning.plan``,
through check_flags.prepare), which parse a command line with Megatron's own code. The
test harness (tests/support/) activates it too, but is not what keeps it in the package.
"""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from megatron_async import cpu_nccl, patch_table
from megatron_async.patch_table import Patch, Scope

CPU = Scope.CPU
_ACTIVE = False
_MODE: "CudaToCpuMode | None" = None
_INSTALLED: list = []  # what activate() replaced (patch_table.install), for deactivate()

# Tensor.type() names that Megatron compares against (clip_grads.py,
# optimizer.py, distrib_optimizer.py all assert on 'torch.cuda.*Tensor').
_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}


def is_active() -> bool:
    return _ACTIVE


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # Integer devices: torch.cuda.current_device() returns 0 and Megatron passes it
    # as device= to factories (e.g. DDP buffers, tensor_parallel.layers).
    return isinstance(device, int) and not isinstance(device, bool)


_CPU = torch.device("cpu")


def _cpu_if_cuda(device: Any) -> Any:
    return _CPU if _is_cuda_device(device) else device


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA devices to the CPU in every torch call.

    Covers tensor factories (``torch.empty(..., device='cuda')``), ``Tensor.to('cuda')``,
    ``Tensor.to(0)``, ``Tensor.cuda()`` and ``Tensor.type()`` (which reports the CUDA
    type name Megatron's optimizer asserts expect).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = _CUDA_TYPE_NAMES.get(args[0].dtype)
            if name is not None:
                return name
        if func is torch.Tensor.to:
            args = tuple(_cpu_if_cuda(a) for a in args)
        device = kwargs.get("device")
        if device is not None and _is_cuda_device(device):
            kwargs["device"] = _CPU
        return func(*args, **kwargs)


class _Event:
    """torch.cuda.Event on the CPU: ops run eagerly, so every event is complete.

    Needed by the MoE token dispatchers and by DDP/optimizer overlap code, which
    record events on side streams and wait on them.
    """

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self._time = None

    def record(self, stream=None):
        import time

        self._time = time.perf_counter()

    def wait(self, stream=None):
        pass

    def query(self):
        return True

    def synchronize(self):
        pass

    def elapsed_time(self, end: "_Event") -> float:
        return (end._time - self._time) * 1000.0


class _Stream:
    """torch.cuda.Stream on the CPU: one in-order stream, so waits are no-ops.

    Needed by the MoE dispatchers (shared-expert and comm streams), DDP's
    communication stream, the distributed optimizer's all-gather overlap and the
    communication stream of Megatron's combined 1F1B step (`set_streams`, which asks for
    the priority range when it wants a high-priority stream).
    """

    def __init__(self, device=None, priority: int = 0, **kwargs):
        self.device = _CPU
        self.priority = priority

    @staticmethod
    def priority_range() -> tuple:
        """(lowest, highest) as CUDA orders them: a lower number is a higher priority."""
        return 0, -1

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        event = event or _Event()
        event.record(self)
        return event

    def synchronize(self):
        pass

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_DEFAULT_STREAM = _Stream()


@contextlib.contextmanager
def _stream_ctx(stream=None):
    yield stream


class _DeviceCtx:
    """torch.cuda.device(idx) as a no-op context (tensor_parallel.random uses it)."""

    def __init__(self, device=None):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


SEND_WAIT_ENV = cpu_nccl.SEND_WAIT_ENV
_NCCL = cpu_nccl.EmulatedNccl()  # this process's emulated device and communicators


def outstanding_sends() -> int:
    """Sends this process posted that nobody has waited on (gloo reports completion only then)."""
    return _NCCL.outstanding("send")


def _synchronize(device=None) -> None:
    _NCCL.wait_all("torch.cuda.synchronize")


def _empty_cache() -> None:
    _NCCL.wait_all("torch.cuda.empty_cache")


def _cuda_patches() -> list:
    """Replacements for the torch.cuda functions Megatron calls: (name, value, who calls it)."""
    placement = "device placement: parallel_state, DDP buffers, tensor_parallel layers"
    # with every send, receive and collective posted, which a whole-device wait waits for (cpu_nccl.py)
    waits = "ordering with the host and every posted operation: training loops, timers, checkpointing"
    streams = "streams and events: MoE dispatchers, DDP overlap, the distributed optimizer"
    # torch.manual_seed itself calls torch.cuda.manual_seed_all: the generator is seeded directly
    rng = "tensor_parallel.random (RNG tracker, model_parallel_cuda_manual_seed): the CPU default generator"
    memory = "memory reports in Megatron's training utilities"
    return [
        ("current_device", lambda: 0, placement),
        ("device_count", lambda: 1, placement),
        ("set_device", lambda device: None, placement),
        ("device", _DeviceCtx, placement),
        ("synchronize", _synchronize, waits),
        ("empty_cache", _empty_cache, waits),
        ("Event", _Event, streams),
        ("Stream", _Stream, streams),
        ("current_stream", lambda device=None: _DEFAULT_STREAM, streams),
        ("default_stream", lambda device=None: _DEFAULT_STREAM, streams),
        ("stream", _stream_ctx, streams),
        ("get_rng_state", lambda device="cuda": torch.default_generator.get_state(), rng),
        ("set_rng_state", lambda new_state, device="cuda": torch.default_generator.set_state(new_state), rng),
        ("manual_seed", lambda seed: torch.default_generator.manual_seed(int(seed)) and None, rng),
        ("manual_seed_all", lambda seed: None, rng),
        ("seed", lambda: None, rng),
        ("seed_all", lambda: None, rng),
        ("initial_seed", lambda: torch.default_generator.initial_seed(), rng),
        ("memory_allocated", lambda device=None: 0, memory),
        ("max_memory_allocated", lambda device=None: 0, memory),
        ("memory_reserved", lambda device=None: 0, memory),
        ("max_memory_reserved", lambda device=None: 0, memory),
        ("reset_peak_memory_stats", lambda device=None: None, memory),
        ("get_device_capability", lambda device=None: (0, 0), "architecture checks"),
        ("get_device_properties", lambda device=None: _EMULATED_PROPERTIES,
         "Megatron's validate_args reads the architecture (major) with TP > 1"),
        ("get_device_name", lambda device=None: "cpu (cuda emulation)", "device reports"),
    ]


_EMULATED_PROPERTIES = types.SimpleNamespace(name="cpu (cuda emulation)", major=0, minor=0, total_memory=0,
                                             multi_processor_count=1)


def _set_cuda_rng_state(original):
    """Megatron's CUDA RNG tracker calls _set_cuda_rng_state, which indexes
    torch.cuda.default_generators; on the CPU the state is the CPU generator's."""

    def set_state(new_state, device=-1, graph_safe=False):
        torch.default_generator.set_state(new_state)

    return set_state


def _get_cuda_rng_state(original):
    def get_state(device="cuda", clone=False, graph_safe=False):
        return torch.default_generator.get_state()

    return original if original is patch_table.ABSENT else get_state


def _quiet_rng_fork_warning(owner):
    """tracker.fork() warns when the CPU RNG changes inside a CUDA RNG fork; here the
    CUDA RNG *is* the CPU RNG, so that warning is expected and only noise."""
    from megatron.core.tensor_parallel import random as mp_random

    def quiet(record):
        return "CPU RNG state changed" not in record.getMessage()

    owner.getLogger(mp_random.__name__).addFilter(quiet)
    return quiet


def _loud_rng_fork_warning(owner, quiet) -> None:
    from megatron.core.tensor_parallel import random as mp_random

    owner.getLogger(mp_random.__name__).removeFilter(quiet)


def _torch_norm_for_sequence_parallel(original):
    """Without apex, Megatron's local layer spec normalises with torch's LayerNorm or
    RMSNorm, which refuse sequence parallelism only because nothing marks their weights
    (apex's norms do). Build the same torch norm and mark its parameters
    `sequence_parallel`, so finalize_model_grads all-reduces their gradients over the
    tensor-parallel group, as on GPUs."""
    import copy

    def new(cls, config, hidden_size, *args, **kwargs):
        if not config.sequence_parallel:
            return original(cls, config, hidden_size, *args, **kwargs)
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = original(cls, plain, hidden_size, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    return new


def _missing_te_general_gemm(original):
    """megatron-core 0.19.2 imports `te_general_gemm` from its TE extension in
    moe_utils; without Transformer Engine the name may be absent. Define it as None
    so MoE routing takes its plain-PyTorch path."""
    return None if original is patch_table.ABSENT else original


def _backward_in_mode(original):
    """Torch function modes are not active while autograd runs a custom Function's
    backward. Megatron's backward passes allocate with device=current_device()
    (tensor_parallel.mappings gather/scatter, MoE all-to-all), so re-enter the
    mode around every custom backward."""

    def apply_on_cpu(self, *args):
        if torch._C._len_torch_function_stack() > 0:
            return original(self, *args)
        with _MODE:
            return original(self, *args)

    return apply_on_cpu


def _enter_cuda_to_cpu_mode(owner):
    global _MODE
    _MODE = CudaToCpuMode()
    _MODE.__enter__()
    return _MODE


def _leave_cuda_to_cpu_mode(owner, mode) -> None:
    global _MODE
    if torch._C._len_torch_function_stack() == 0 or torch.overrides._get_current_function_mode() is not mode:
        raise RuntimeError("megatron-async: the CUDA emulation's torch function mode is not the innermost one")
    mode.__exit__(None, None, None)
    _MODE = None


def _moe_host_copies(original):
    """The MoE all-to-all dispatcher copies its split sizes to the host with
    maybe_move_tensor_to_cpu(as_numpy=True), which does nothing unless
    `tensor.is_cuda`; on the CPU the sizes would stay tensors, which gloo's
    all_to_all_single rejects. Convert them on the CPU too."""

    def to_host(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.detach().cpu().numpy()
        return tensor

    return original if original is patch_table.ABSENT else to_host


def _without_apex_or_te(make):
    """A DistributedOptimizer method replaced only where Megatron wraps torch's Adam (no
    Transformer Engine, no apex) and its `step` handling fails to resume."""

    @functools.wraps(make)
    def wrap(original):
        from megatron.core.optimizer import distrib_optimizer

        return original if distrib_optimizer.HAVE_APEX_OR_TE else make(original)

    return wrap


@_without_apex_or_te
def _adam_state_dict(original):
    """Megatron-Core 0.19.2's distributed optimizer cannot resume from its own checkpoint
    in a CPU run, for reasons GPU runs (Transformer Engine's FusedAdam, bf16) do not meet.

    Without Transformer Engine or apex it wraps torch's Adam, which keeps `step` in each
    parameter's state (FusedAdam: in the param group), and mishandles that `step` three times:
    a load builds the sharded state dict through `state_dict()`, which asserts on the one
    `step` of that state before any step has created it (`assert len(steps) == 1`); the
    parameter-state loaders then copy the placeholder `step` taken then over the one loaded
    from the param groups (a resume restarts Adam's bias correction at step 0); and
    `load_state_dict` gives every parameter the same `step` tensor, which torch's Adam
    increments once per parameter. Here an optimizer that has not stepped reports step 0
    (its state stays empty, so Megatron allocates it as it does), the parameter-state copy
    leaves `step` alone, and each parameter gets its own copy of the loaded step.

    With fp32 parameters the main parameters are views of the model's (with bf16, fp32
    copies), and the DP-reshardable and torch-format loaders copy into them with autograd
    on, which torch refuses for a view of a leaf that requires grad; here that copy runs
    under no_grad, as Megatron's other loaders do."""

    def state_dict(self):
        inner = self.optimizer
        if len(inner.state) or not isinstance(inner, torch.optim.Optimizer):
            return original(self)
        for group in inner.param_groups:
            for param in group["params"]:
                inner.state[param]["step"] = torch.tensor(0.0)
        try:
            return original(self)
        finally:
            inner.state.clear()

    return state_dict


@_without_apex_or_te
def _adam_load_state_dict(original):
    """Each parameter its own copy of the loaded `step` (torch's Adam increments it in place)."""

    def load_state_dict(self, state_dict):
        original(self, state_dict)
        for state in self.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()

    return load_state_dict


@_without_apex_or_te
def _adam_set_states(original):
    """The parameter-state copy leaves `step` alone, and runs under no_grad."""

    @torch.no_grad()
    def set_main_param_and_optimizer_states(self, model_param, tensors):
        original(self, model_param, {**tensors, "step": None})  # not a tensor: not copied

    return set_main_param_and_optimizer_states


FUSED_WGRAD_MODULE = "fused_weight_gradient_mlp_cuda"


def _flat_fp32_wgrad(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> torch.Tensor:
    """grad_output^T @ total_input over the flattened leading dims, computed in fp32."""
    inp = total_input.reshape(-1, total_input.shape[-1]).float()
    grad = grad_output.reshape(-1, grad_output.shape[-1]).float()
    if main_grad.shape != (grad.shape[1], inp.shape[1]):
        raise ValueError(f"weight-gradient accumulation: main_grad {tuple(main_grad.shape)} does not match "
                         f"grad_output {tuple(grad_output.shape)} x input {tuple(total_input.shape)}")
    return grad.t().matmul(inp)


def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """apex's kernel on the CPU: main_grad (fp32) += grad_output^T @ input, inputs upcast.
    Computed as the product, then one addition: what Megatron's unfused path does
    (wgrad, then DDP's hook adds it to main_grad), so fusion changes no fp32 result."""
    if main_grad.dtype != torch.float32:
        raise TypeError(f"wgrad_gemm_accum_fp32 accumulates into an fp32 main_grad, got {main_grad.dtype}")
    main_grad.add_(_flat_fp32_wgrad(total_input, grad_output, main_grad))


def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """apex's fp16/bf16 variant on the CPU: accumulate in fp32, round once into main_grad's dtype."""
    if main_grad.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"wgrad_gemm_accum_fp16 accumulates into an fp16/bf16 main_grad, got {main_grad.dtype}")
    total = main_grad.float() + _flat_fp32_wgrad(total_input, grad_output, main_grad)
    main_grad.copy_(total)


def _fused_wgrad_wanted() -> bool:
    from megatron.core.tensor_parallel import layers

    return not getattr(layers, "_grad_accum_fusion_available", False)


_FUSED_WGRAD = types.ModuleType(FUSED_WGRAD_MODULE, "weight-gradient accumulation (CPU emulation of apex's kernel)")
_FUSED_WGRAD.wgrad_gemm_accum_fp32 = wgrad_gemm_accum_fp32
_FUSED_WGRAD.wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp16


def _provide_fused_wgrad_module(owner):
    """Megatron's local linear layers fuse the weight-gradient GEMM with the
    accumulation into `main_grad` through apex's CUDA extension, which
    tensor_parallel/layers.py imports at import time and otherwise refuses
    `gradient_accumulation_fusion` (Megatron's default). Provide the module with the
    same semantics in torch ops, so CPU runs take the same backward path as GPUs
    (the dummy weight gradient and DDP's `grad_added_to_main_grad` included);
    megatron.core.utils imports it at call time."""
    if not _fused_wgrad_wanted():
        return None
    previous = owner.modules.get(FUSED_WGRAD_MODULE, patch_table.ABSENT)
    owner.modules[FUSED_WGRAD_MODULE] = _FUSED_WGRAD
    return (previous,)


def _withdraw_fused_wgrad_module(owner, undo) -> None:
    (previous,) = undo
    if previous is patch_table.ABSENT:
        owner.modules.pop(FUSED_WGRAD_MODULE, None)
    else:
        owner.modules[FUSED_WGRAD_MODULE] = previous


def _one_connection(owner):
    """Megatron's validate_args demands CUDA_DEVICE_MAX_CONNECTIONS=1 for TP/CP > 1 before
    Blackwell; it means nothing here, and the emulated device reports no architecture."""
    if "CUDA_DEVICE_MAX_CONNECTIONS" in owner.environ:
        return None
    owner.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    return True


def _unset_one_connection(owner, undo) -> None:
    owner.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)


def _record_nothing(tensor: torch.Tensor, stream) -> None:
    """Tensor.record_stream on one in-order stream: a tensor is free once the host moves on."""


def _value(value):
    """A patch whose replacement does not depend on the original."""
    return lambda original: value


def _tables():
    """The emulation's tables, in the order they are installed: torch (before Megatron is
    imported), the NCCL model (cpu_nccl.py), then Megatron's names."""
    cuda = tuple(Patch("torch.cuda", name, why, _value(value), CPU) for name, value, why in _cuda_patches())
    torch_patches = cuda + (
        Patch("torch.overrides", "CudaToCpuMode (entered)",
              "every torch call: CUDA devices become the CPU, Tensor.cuda() and Tensor.type() answer as on a GPU",
              _enter_cuda_to_cpu_mode, CPU, restore=_leave_cuda_to_cpu_mode),
        Patch("torch:Tensor", "record_stream",
              "Megatron's combined 1F1B step marks the tensors it frees or hands between streams; one in-order "
              "stream has nothing to record (torch checks for a CUDA stream before any function mode sees the call)",
              _value(_record_nothing), CPU),
        Patch("torch.autograd.function:BackwardCFunction", "apply",
              "autograd runs a custom Function's backward outside the torch function mode: re-entered there",
              _backward_in_mode, CPU),
        Patch("os", "environ[CUDA_DEVICE_MAX_CONNECTIONS]", "Megatron's validate_args with TP/CP > 1",
              _one_connection, CPU, restore=_unset_one_connection),
    )
    random = "megatron.core.tensor_parallel.random"
    dopt = "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer"
    megatron = (
        Patch(random, "_set_cuda_rng_state", "the RNG tracker: the CUDA generator is the CPU's", _set_cuda_rng_state,
              CPU),
        Patch(random, "_get_cuda_rng_state", "the RNG tracker: the CUDA generator is the CPU's", _get_cuda_rng_state,
              CPU, optional=True),
        Patch("logging", f"getLogger({random}).filters", "its warning that the CPU RNG changed in a CUDA fork",
              _quiet_rng_fork_warning, CPU, restore=_loud_rng_fork_warning),
        Patch("megatron.core.transformer.moe.moe_utils", "maybe_move_tensor_to_cpu",
              "the MoE all-to-all's split sizes to the host", _moe_host_copies, CPU),
        Patch("megatron.core.transformer.moe.token_dispatcher", "maybe_move_tensor_to_cpu",
              "the MoE all-to-all's split sizes to the host (its imported name)", _moe_host_copies, CPU,
              optional=True),
        Patch(dopt, "state_dict", "torch's Adam (no TE/apex): a resume's state dict before any step",
              _adam_state_dict, CPU),
        Patch(dopt, "load_state_dict", "torch's Adam (no TE/apex): one `step` tensor per parameter",
              _adam_load_state_dict, CPU),
        Patch(dopt, "_set_main_param_and_optimizer_states", "torch's Adam (no TE/apex): the loaded `step` kept",
              _adam_set_states, CPU),
        Patch("megatron.core.extensions.transformer_engine", "te_general_gemm",
              "moe_utils imports it; None without Transformer Engine", _missing_te_general_gemm, CPU, optional=True),
        Patch("megatron.core.transformer.torch_norm:WrappedTorchNorm", "__new__",
              "torch's norms marked sequence_parallel, as apex's are", _torch_norm_for_sequence_parallel, CPU),
        Patch("sys", f"modules[{FUSED_WGRAD_MODULE}]", "apex's weight-gradient kernel, in torch ops",
              _provide_fused_wgrad_module, CPU, restore=_withdraw_fused_wgrad_module),
        Patch("megatron.core.tensor_parallel.layers", "fused_weight_gradient_mlp_cuda",
              "gradient_accumulation_fusion: apex's kernel, in torch ops",
              lambda original: _FUSED_WGRAD if _fused_wgrad_wanted() else original, CPU, optional=True),
        Patch("megatron.core.tensor_parallel.layers", "_grad_accum_fusion_available",
              "gradient_accumulation_fusion (Megatron's default) allowed", _value(True), CPU),
    )
    return torch_patches, cpu_nccl.patches(_NCCL), megatron


def tables() -> tuple:
    """Every patch the emulation makes, one flat table."""
    return sum(_tables(), ())


def activate() -> bool:
    """Enable CUDA emulation on the CPU. Returns False (and does nothing) with CUDA.
    `torch.cuda.is_available()` stays False: Megatron uses it to choose gloo/CPU paths."""
    global _ACTIVE
    if _ACTIVE:
        return True
    if torch.cuda.is_available():
        return False
    try:
        for table in _tables():
            patch_table.install(table, _INSTALLED)
    except BaseException:
        patch_table.restore(_INSTALLED)
        raise
    _ACTIVE = True
    return True


def deactivate() -> None:
    """Undo every patch of the emulation, last first."""
    global _ACTIVE
    patch_table.restore(_INSTALLED)
    _ACTIVE = False


def setup_device(device: str = "auto") -> str:
    """Resolve `--device {auto,cpu,cuda}` and activate emulation for cpu. Returns 'cpu' or 'cuda'."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda, got {device!r}")
    has_cuda = torch.cuda.is_available()
    if device == "cuda" and not has_cuda:
        raise RuntimeError("--device cuda: no CUDA device is available (use --device cpu)")
    if device == "cpu" and has_cuda:
        raise RuntimeError(
            "--device cpu: CUDA is available; CPU emulation never runs beside CUDA "
            "(use --device cuda or hide the GPUs with CUDA_VISIBLE_DEVICES='')"
        )
    if has_cuda:
        return "cuda"
    activate()
    return "cpu"

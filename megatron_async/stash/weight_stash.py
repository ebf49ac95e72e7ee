"""Weight versions for delayed-gradient training: the live weights plus a stash.

PipeDream-2BW keeps exactly two versions per stage: the newest weights W(t), which
the optimizer owns and updates in place (Megatron DDP's parameter storage), and the
previous version W(t-1), still used by microbatches that started before the last
step. `depth` stashed versions generalise this to a simulated delay of `depth`
steps (depth=1 is 2BW), and a version may be given per parameter, so parts of
the model can run at different delays (a one-process model of a pipeline whose
stages lag by different numbers of steps, as in original PipeDream).

- The stash is flat buffers laid out exactly like Megatron DDP's parameter buffers
  (one per DDP buffer, same offsets), so saving a version is one copy per buffer.
- Running a microbatch at version v repoints every `param.data` to v's storage (no
  copies), or those a piece of the pass reads alone (`point_to(v, only=...)`: a node of
  Megatron's combined step), the stash then recording where each parameter points.
  Tensors autograd saves for the backward that are parameters, or views
  of them (a matmul saves `weight.t()`), are recorded as (param, version, view)
  and rebuilt from that version's storage when the backward unpacks them, so a
  backward always sees the weights of its own forward, even after an optimizer
  step changed the live weights in between, and in-place updates never trip
  autograd's version checks.
- Before a step, the live weights are copied into the slot of the oldest version
  (which no microbatch needs any more); the step then updates the live weights.
- The hooks cost time on every saved tensor, and only a forward whose backward
  comes after an optimizer step needs them (`use(version, hooks=...)`): any other
  backward runs at the same, unchanged storage its forward read, once the params
  are pointed back to its version.
- A saved tensor that shares storage with a weight buffer but is neither a
  parameter nor a view of one (a kernel's own alias of the weight) cannot be
  rebuilt at its version: the hooks raise StashAliasError naming the weight,
  at the first forward, instead of letting its backward read newer weights.

Weight prediction (`--delay-correction predict`, depth 1 only): microbatches run at
a prediction of the weights one step ahead instead of at a stored version: version
v stands for P(v) = W(v) + alpha * (W(v) - W(v-1)), the last update applied once
more (PipeMare, SpecTrain). No microbatch then runs at the live weights, so two
slots hold P(v-1) and P(v); each step writes the new prediction into the slot of
the one no microbatch needs any more: one weight copy more than 2BW.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence, Union

import torch

from megatron_async.stash import param_gather
from megatron_async.stash import fused_wgrad

Version = Union[int, tuple[int, ...]]  # one version for every parameter, or one per parameter


class StashAliasError(RuntimeError):
    """A tensor saved for backward aliases a weight's storage in a way the stash cannot rebuild."""


class WeightStashManager:
    """The live version plus `depth` stashed versions of one stage's parameters."""

    def __init__(self, model_chunks, depth: int = 1, predict: float | None = None, guard_aliases: bool = True):
        if depth < 1:
            raise ValueError("a weight stash needs depth >= 1 (depth 0 is plain training)")
        if predict is not None and depth != 1:
            raise ValueError("weight prediction is defined for a one-step delay (depth 1)")
        self.predict = predict  # alpha of the weight prediction, None: stored versions
        self.slots = depth if predict is None else 2
        self.depth = depth
        self.newest = 0  # version held by the live weights
        self.restored = False  # the stash came back from a checkpoint (else it holds construction-time copies)
        self.params: list[torch.nn.Parameter] = []
        self._live: list[torch.Tensor] = []  # each param's live storage (DDP's views)
        self._slots: list[list[torch.Tensor]] = [[] for _ in range(self.slots)]  # flat buffers per slot
        self._slot_views: list[list[torch.Tensor]] = [[] for _ in range(self.slots)]
        self._slot_version: list[int] = [0] * self.slots
        self._index = {}
        self.guard_aliases = guard_aliases
        self.chunks = list(model_chunks)  # DDP's chunks: their buffers hold the live weights
        self._copying_gather = param_gather.copies_through_params(self.chunks)
        self._gather_due = False  # a step came, and that gather has not run since (param_gather.py)
        self._overlapped = param_gather.overlapped(self.chunks)
        self._update_scattered = False  # a step came, and no forward has gathered its update since
        for chunk in self.chunks:
            for buffer in list(chunk.buffers) + list(chunk.expert_parallel_buffers):
                self._add_buffer(buffer)
        self._names = _param_names(self.chunks)
        self._by_id = {id(p): p for p in self.params}  # for fused_weights, once per hooked forward
        # every storage that holds some version of the weights, for the alias guard
        self._weight_storages = {_storage_ptr(t) for t in self._live} | {
            _storage_ptr(flat) for slot in self._slots for flat in slot}
        self._weight_storages.discard(None)
        self._pointed = self.newest
        self._each = None  # after a switch of some parameters (`only`): the version each points at
        self.copy_live_into_stash(all_slots=True)
        if predict is not None:
            self._slot_version = [0, -1]  # P(0) = W(0); the other slot is free
            self._pointed = None  # the live weights are no version's forward storage

    def _add_buffer(self, buffer) -> None:
        dtype = buffer.param_dtype
        numel = buffer.numel
        flats = [torch.zeros(numel, dtype=dtype, device=buffer.grad_data.device) for _ in range(self.slots)]
        for slot, flat in enumerate(flats):
            self._slots[slot].append(flat)
        for param, (start, end, _bucket) in buffer.param_index_map.items():
            self._index[id(param)] = len(self.params)
            self.params.append(param)
            self._live.append(param.data)
            for slot, flat in enumerate(flats):
                self._slot_views[slot].append(flat[start:end].view(param.data.shape))

    # --- versions -------------------------------------------------------------
    def _storage(self, version: int) -> list[torch.Tensor]:
        if version == self.newest and self.predict is None:
            return self._live
        for slot, held in enumerate(self._slot_version):
            if held == version:
                return self._slot_views[slot]
        raise RuntimeError(
            f"weight version {version} is not held (newest {self.newest}, stash {sorted(set(self._slot_version))})"
        )

    def _storages(self, version: Version) -> list[torch.Tensor]:
        if isinstance(version, int):
            return self._storage(version)
        if len(version) != len(self.params):
            raise ValueError(f"{len(version)} per-parameter versions for {len(self.params)} parameters")
        by_version = {v: self._storage(v) for v in set(version)}
        return [by_version[v][i] for i, v in enumerate(version)]

    def point_to(self, version: Version, only: Optional[Sequence[int]] = None) -> None:
        """Make every parameter's data the weights of `version`: one version for all,
        or a tuple with one version per parameter (in the order of `self.params`).

        `only`: the positions (`indices_of`) of the parameters to point, the others left where
        they point: for a piece of a pass that reads those alone (a node of Megatron's combined
        step), so a switch costs its own parameters, not the stage's."""
        if version == self._pointed:
            return
        if self._gather_due:  # before the copying gather could land in a stash slot
            self._point_live()
            param_gather.gather_all_now(self.chunks)
            self._gather_due = False
        storages = self._storages(version)
        if only is not None:
            each = self._each
            if each is None:  # from one version for all (or none known) to one a parameter
                each = self._each = [self._pointed] * len(self.params)
            params = self.params
            for i in only:
                if each[i] != version:
                    params[i].data = storages[i]
                    each[i] = version
            self._pointed = None  # the parameters may point at more than one version now
            return
        for param, data in zip(self.params, storages):
            param.data = data
        self._pointed, self._each = version, None

    def indices_of(self, params) -> tuple[int, ...]:
        """The positions in `self.params` of those of `params` the stash holds (for `only`)."""
        return tuple(self._index[id(p)] for p in params if id(p) in self._index)

    def live_storage(self, param: torch.nn.Parameter) -> torch.Tensor:
        """`param`'s live storage (DDP's view), wherever `param.data` points now."""
        return self._live[self._index[id(param)]]

    def versions_held(self) -> list[int]:
        return sorted({self.newest, *self._slot_version})

    @contextlib.contextmanager
    def use(self, version: Version, hooks: bool = True, only: Optional[Sequence[int]] = None) -> Iterator[None]:
        """Run a forward at `version` (see `point_to`, and its `only`); its backward will see
        the same weights (a backward only needs `point_to`).

        `hooks=False` only points the parameters: right where no optimizer step falls
        between this forward and its backward (which must then run at the same version).
        """
        self.point_to(version, only)
        self._update_scattered = False  # the forward's pre-hooks gather every bucket it reads
        if not hooks:
            yield
            return
        index = self._index
        guard = self._check_not_alias if self.guard_aliases else None

        def pack(tensor):
            i = index.get(id(tensor))
            if i is not None and tensor is self.params[i]:
                return (i, version, None)
            # Views of a parameter (e.g. the `weight.t()` a matmul saves) alias the
            # storage of the version in use now; record how to rebuild them.
            base = tensor._base
            if base is not None:
                i = index.get(id(base))
                if i is not None and base is self.params[i]:
                    offset = tensor.storage_offset() - base.storage_offset()
                    return (i, version, (tensor.size(), tensor.stride(), offset))
            if guard is not None:
                guard(tensor)
            return tensor

        def unpack(saved):
            if not isinstance(saved, tuple):
                return saved
            i, v, view = saved
            self.point_to(v, (i,))  # the weight it rebuilds; a backward reads only what it saved
            param = self.params[i]
            if view is None:
                return param
            size, stride, offset = view
            data = param.data
            return data.as_strided(size, stride, data.storage_offset() + offset)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    def fused_weights(self, outputs) -> list[torch.nn.Parameter]:
        """After a forward under `use(..., hooks=True)`: the weights its fused linear
        layers accumulate into `main_grad`, whose backward sees plain tensors (fused_wgrad.py)."""
        return fused_wgrad.fused_weights(outputs, self._by_id)

    def _check_not_alias(self, tensor: torch.Tensor) -> None:
        if _storage_ptr(tensor) not in self._weight_storages:
            return
        name = self._owner_name(tensor)
        raise StashAliasError(
            f"megatron-async: a tensor saved for backward (shape {tuple(tensor.shape)}) shares the storage of "
            f"weight {name!r} but is neither that parameter nor a view of it, so the weight stash cannot give its "
            "backward the weights of its forward: under 2bw an optimizer step falls between the two, and the "
            "backward would silently read the newer weights. The layer keeps its own alias of the weight (for "
            "example a detached copy or a quantized weight sharing its storage); run it without 2bw, or make it "
            "save the parameter itself")

    def _owner_name(self, tensor: torch.Tensor) -> str:
        """The parameter whose storage range holds `tensor`'s first element (for messages)."""
        ptr, offset = _storage_ptr(tensor), tensor.storage_offset()
        for i in range(len(self.params)):
            for held in [self._live[i]] + [views[i] for views in self._slot_views]:
                start = held.storage_offset()
                if _storage_ptr(held) == ptr and start <= offset < start + max(held.numel(), 1):
                    return self.param_name(i)
        return "a weight buffer"

    # --- optimizer step -------------------------------------------------------
    @torch.no_grad()
    def copy_live_into_stash(self, all_slots: bool = False) -> None:
        """Save the live weights (version `newest`) over the oldest stashed version."""
        slots = range(self.slots) if all_slots else [self._oldest_slot()]
        for slot in slots:
            torch._foreach_copy_(self._slot_views[slot], self._live)  # one multi-tensor launch, not one per weight
            self._slot_version[slot] = self.newest

    def _oldest_slot(self) -> int:
        return min(range(self.slots), key=self._slot_version.__getitem__)

    def _point_live(self) -> None:
        for param, data in zip(self.params, self._live):
            param.data = data
        self._pointed = None if self.predict is not None else self.newest
        self._each = None

    def gather_update(self, params) -> None:
        """Before the tied link sends or overwrites the live `params`: gather the last step's
        update of them (`--overlap-param-gather`) where no forward has since. Once a forward ran,
        its pre-hooks gathered every bucket, and gathering again is wrong, not only slow: the
        layer-wise optimizer gathers through the gradient buffer and zeroes it, and before a step
        that buffer holds the step's reduced gradients."""
        if not self._update_scattered:
            return
        if self._copying_gather:  # its gather copies into param.data: the live weights
            self._point_live()
        param_gather.gather_now(self.chunks, params, dispatch_next=not self._copying_gather)

    def finish_param_gathers(self) -> int:
        """Make the live weights whole: wait for the overlapped all-gathers of the last step's
        update (`--overlap-param-gather`, stash/param_gather.py), before anything reads them."""
        return param_gather.finish_param_gathers(self.chunks)

    @contextlib.contextmanager
    def optimizer_step(self) -> Iterator[None]:
        """Wrap the optimizer step: stash the live version, step on it, bump `newest`
        (with prediction: then turn the stashed W(v) into P(v+1) = W(v+1) + alpha (W(v+1) - W(v)))."""
        slot = self._oldest_slot()
        self.copy_live_into_stash()
        self._point_live()
        yield
        self._gather_due = self._copying_gather
        self._update_scattered = self._overlapped
        self.newest += 1
        if self.predict is not None:
            with torch.no_grad():
                for old, live in zip(self._slot_views[slot], self._live):
                    old.sub_(live).mul_(-self.predict).add_(live)  # live + alpha (live - old)
            self._slot_version[slot] = self.newest
        self._pointed = None if self.predict is not None else self.newest

    @torch.no_grad()
    def start_equal_at(self, step: int) -> None:
        """Resume at `step` from weights alone (a checkpoint without a stash): every
        older version the next steps ask for (step-1, ..., step-depth) is a copy of
        the live weights."""
        self.newest = step
        self.copy_live_into_stash(all_slots=True)
        self._slot_version = [max(step - 1 - slot, 0) for slot in range(self.depth)]
        if self.predict is not None:  # P(step - 1) = P(step) = W(step): no update history
            self._slot_version = [step - 1, step] if step > 0 else [0, -1]
        self._pointed = None
        self._point_live()

    @torch.no_grad()
    def holds_live(self) -> bool:
        """Whether the first slot still equals the live weights (false once a checkpoint
        load, or anything else, changed the weights after the stash copied them)."""
        return all(torch.equal(old, live) for old, live in zip(self._slot_views[0], self._live))

    # --- accounting and checkpoints --------------------------------------------
    def num_weight_buffers(self) -> int:
        """Distinct weight versions in memory: the live one plus the stash slots."""
        return 1 + self.slots

    def stash_bytes(self) -> int:
        return sum(flat.numel() * flat.element_size() for slot in self._slots for flat in slot)

    def live_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._live)

    def state_dict(self) -> dict:
        """The stash for a per-rank checkpoint file, streamed to host memory one flat
        buffer at a time: a save adds no copy of the weights on the GPU."""
        return {
            "newest": self.newest,
            "slot_version": list(self._slot_version),
            "slots": [[flat.detach().to("cpu", copy=True) for flat in slot] for slot in self._slots],
        }

    def param_name(self, index: int) -> str:
        return self._names.get(id(self.params[index]), f"parameter #{index}")

    def slot_views(self) -> list[list[torch.Tensor]]:
        """Each slot's per-parameter views (shaped like the parameters), for checkpoints."""
        return self._slot_views

    def slot_versions(self) -> list[int]:
        return list(self._slot_version)

    @torch.no_grad()
    def load_versions(self, newest: int, slot_version: list, slots: list) -> None:
        """Restore from per-parameter tensors (slots x parameters), as a resharded
        checkpoint gives them back."""
        if len(slots) != self.slots:
            raise ValueError(f"the checkpoint's weight stash has {len(slots)} slots, this run needs {self.slots}")
        for views, tensors in zip(self._slot_views, slots):
            for view, tensor in zip(views, tensors):
                if tensor.data_ptr() != view.data_ptr():  # torch_dist may have loaded in place
                    view.copy_(tensor)
        self.newest = newest
        self._slot_version = list(slot_version)
        self.restored = True
        self._pointed = None
        self._point_live()

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        if len(state["slots"]) != self.slots:
            raise ValueError(f"the checkpoint's weight stash has {len(state['slots'])} slots, this run needs "
                             f"{self.slots} (--delay-correction predict keeps two predictions, 2bw one version)")
        self.newest = state["newest"]
        self._slot_version = list(state["slot_version"])
        self.restored = True
        for slot, flats in zip(self._slots, state["slots"]):
            for dst, src in zip(slot, flats):
                dst.copy_(src)
        self._pointed = None
        self._point_live()


def _storage_ptr(tensor: torch.Tensor):
    """The address of `tensor`'s storage, or None (no storage, e.g. a wrapper subclass)."""
    try:
        return tensor.untyped_storage().data_ptr() or None
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _param_names(model_chunks) -> dict[int, str]:
    """id(param) -> its name inside the model (wrapper prefixes such as DDP's 'module.' dropped)."""
    names = {}
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            while name.startswith("module."):
                name = name[len("module."):]
            names.setdefault(id(param), name)
    return names

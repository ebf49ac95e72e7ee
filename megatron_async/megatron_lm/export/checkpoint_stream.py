"""A torch_dist checkpoint's model weights read one tensor group (the embedding, a layer, the
output) at a time, so the export holds one group in memory, never the whole model.

What to read comes from Megatron's own GPT, built on the meta device from the saved arguments
at one stage (megatron_model.py): its `sharded_state_dict()` names each weight's key in the
checkpoint and where the weight sits in it (a layer's offset on the stacked layer axis, an
expert's on the expert axis); Megatron's factories split SwiGLU's [gate; up] as it was saved
and join it again. The bytes are read by torch.distributed.checkpoint with a load plan of
exactly those chunks (`ChunkReads`), which reads only the saved chunks they overlap, whatever
PP / TP / EP layout wrote them. Megatron's own `dist_checkpointing.load` asks for the whole
of each key across its ranks and so cannot load one layer in a one-process group.

A requested chunk the checkpoint does not hold in full (a key missing, another shape or
dtype, a part no saved chunk covers) is refused: the memory it would be read into holds
whatever was there before. The weights are the live ones, the model's own keys; the 2bw
stash's copies (`weight_stash.slot*` keys) are never asked for.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron_async.megatron_lm.export import ExportError

MTP = "mtp."


def _checkpoint_key(sharded) -> str:
    """The key a weight is saved under (its ShardedTensor's key)."""
    return sharded.key


def _group_of(key: str) -> str | None:
    """The group a weight of the one-stage model is read with: 'embedding', 'layer N',
    'output' (final norm, output layer); None for multi-token-prediction layers (not read)."""
    if key.startswith(MTP):
        return None
    parts = key.split(".")
    if parts[:2] == ["decoder", "layers"]:
        return f"layer {int(parts[2])}"
    return "embedding" if parts[0] == "embedding" else "output"


class IndexOnce(FileSystemReader):
    """torch.distributed.checkpoint's file reader that unpickles the index (`.metadata`, which
    lists the optimizer's and the stash's chunks too) once for all the groups' reads."""

    def __init__(self, directory: str):
        super().__init__(directory)
        self._index = None

    def read_metadata(self, *args, **kwargs):
        if self._index is None:
            self._index = super().read_metadata(*args, **kwargs)
        return self._index


@dataclasses.dataclass
class Weights:
    """The checkpoint at `directory` as groups of the one-stage model's sharded weights, in
    the order embedding, layers, output; `mtp_keys`: the weights left out."""

    directory: str
    groups: list[tuple[str, dict]]
    mtp_keys: list[str]
    reader: IndexOnce = None

    def __post_init__(self):
        self.reader = self.reader or IndexOnce(self.directory)

    def meta(self, name: str) -> dict[str, torch.Tensor]:
        """A group's weights as meta tensors (their shapes and dtypes; nothing is read)."""
        return {key: torch.empty(sharded.data.shape, dtype=sharded.data.dtype, device="meta")
                for key, sharded in dict(self.groups)[name].items()}

    def read(self, name: str) -> dict[str, torch.Tensor]:
        """A group's weights, read from the checkpoint."""
        return read_group(self.directory, dict(self.groups)[name], self.reader)

    def check(self) -> None:
        """Refuse, before anything is read or written, a checkpoint that does not hold every
        chunk of every group whole (its `.metadata` alone says)."""
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

        metadata = self.reader.read_metadata()
        for _, group in self.groups:
            request = dict(group)  # apply_factories replaces values; the meta data stays shared
            apply_factories(request)
            planner = ChunkReads(self.directory, [s for s in nested_values(request) if isinstance(s, ShardedTensor)])
            planner.metadata = metadata
            planner.create_local_plan()


def open_weights(directory: str, args) -> Weights:
    """The one-stage model's weights in `directory`, grouped; built on the meta device."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    from megatron_async.megatron_lm.export import megatron_model

    megatron_model.start_process_group()
    with torch.device("meta"):
        model = megatron_model.build_model(megatron_model.model_config(megatron_model.one_stage_args(args)))
    groups: dict[str, dict] = {}
    mtp = []
    for key, sharded in model.sharded_state_dict().items():
        if not isinstance(sharded, (ShardedTensor, ShardedTensorFactory)):
            continue  # modules' extra state: no weight
        group = _group_of(key)
        if group is None:
            mtp.append(key)
        else:
            groups.setdefault(group, {})[key] = sharded
    layers = sorted((name for name in groups if name.startswith("layer ")), key=lambda n: int(n.split()[1]))
    order = [name for name in ("embedding", *layers, "output") if name in groups]
    return Weights(directory, [(name, groups[name]) for name in order], mtp)


def read_group(directory: str, group: dict, reader: FileSystemReader | None = None) -> dict[str, torch.Tensor]:
    """One group's weights: fresh CPU tensors, filled from the checkpoint chunk by chunk. A
    weight a factory split (SwiGLU's [gate; up]) is joined one at a time, its halves' memory
    let go before the next, so the group is held about once."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory, apply_factories

    request = {key: dataclasses.replace(sharded, data=torch.empty(sharded.data.shape, dtype=sharded.data.dtype))
               for key, sharded in group.items()}
    merges = {key: sharded.merge_fn for key, sharded in request.items() if isinstance(sharded, ShardedTensorFactory)}
    apply_factories(request)
    _read_chunks(directory, [sharded for sharded in nested_values(request) if isinstance(sharded, ShardedTensor)],
                 reader or FileSystemReader(directory))
    weights = {}
    for key in list(request):
        loaded = dict_list_map_inplace(lambda sharded: sharded.data if isinstance(sharded, ShardedTensor) else sharded,
                                       request.pop(key))
        weights[key] = merges[key](loaded) if key in merges else loaded
        del loaded
    return weights


def _read_chunks(directory: str, chunks: list, reader: FileSystemReader) -> None:
    """Fill each ShardedTensor's data with its chunk of the checkpoint."""
    import torch.distributed.checkpoint as dcp

    dcp.load({}, storage_reader=reader, planner=ChunkReads(directory, chunks), no_dist=True)


class ChunkReads(DefaultLoadPlanner):
    """torch.distributed.checkpoint's load plan for the given chunks only, each checked to be
    held whole by the checkpoint."""

    def __init__(self, directory: str, chunks: list):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.directory = directory
        self.targets: dict[str, list[torch.Tensor]] = {}
        self.requests: dict[str, list] = {}
        for sharded in chunks:
            if sharded.flattened_range is not None:
                raise RuntimeError(f"megatron-async: {sharded.key} is a flattened model weight; the export "
                                   "reads whole chunks only")
            shape = (1,) * sharded.prepend_axis_num + tuple(sharded.local_shape)
            key = _checkpoint_key(sharded)
            self.requests.setdefault(key, []).append(sharded)
            self.targets.setdefault(key, []).append(sharded.data.view(shape))

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, requested in self.requests.items():
            items += self._reads(key, requested, self.targets[key])
        return LoadPlan(items)

    def _reads(self, key: str, requested: list, targets: list) -> list:
        """The reads that fill `targets` (the chunks of `key` requested), or a refusal."""
        where = f"--load: {self.directory}"
        saved = self.metadata.state_dict_metadata.get(key)
        if not isinstance(saved, TensorStorageMetadata):
            raise ExportError(f"{where} holds no tensor {key}, which the saved arguments' model has "
                              "(a torn checkpoint, or one of another model)")
        first = requested[0]
        if tuple(saved.size) != tuple(first.global_shape) or saved.properties.dtype != first.data.dtype:
            raise ExportError(f"{where}: {key} is {tuple(saved.size)} {saved.properties.dtype} in the checkpoint, "
                              f"{tuple(first.global_shape)} {first.data.dtype} in the saved arguments' model "
                              "(a checkpoint of another model)")
        local = [ChunkStorageMetadata(offsets=torch.Size(s.global_offset), sizes=t.shape)
                 for s, t in zip(requested, targets)]
        reads = create_read_items_for_chunk_list(key, saved, local)
        covered = [0] * len(local)
        for item in reads:
            covered[item.dest_index.index] += math.prod(item.lengths)
        for chunk, got in zip(local, covered):
            if got != math.prod(chunk.sizes):
                raise ExportError(f"{where} is torn: no saved chunk holds part of {key} at offset "
                                  f"{tuple(chunk.offsets)} ({got} of {math.prod(chunk.sizes)} values are saved)")
        return reads

    def lookup_tensor(self, index) -> torch.Tensor:
        return self.targets[index.fqn][index.index]

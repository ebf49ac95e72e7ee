"""Safetensors files written one tensor at a time, split as transformers splits a model.

The export never holds the model whole, so the files cannot come from `safetensors.save_file`
(which takes every tensor of a file at once and copies each into bytes). Every tensor's name,
shape and dtype is known before any is read, so each file's header is written first and the
tensors' bytes are appended as they arrive. The files follow safetensors' format (an 8-byte
little-endian header length, a JSON header padded with spaces to 8 bytes, the data) and
transformers' convention: one `model.safetensors` when the model fits in `max_shard_size`,
else `model-0000i-of-0000n.safetensors`, filled in order up to that size (a tensor larger
than it alone in its file), and `model.safetensors.index.json` naming each tensor's file,
written last.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct

import torch

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"
DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """Bytes of a size written as Hugging Face writes them ("5GB", "500MB", "2GiB", "1000000")."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(text).upper())
    if not found:
        raise ValueError(f"{text!r} is not a size (say 5GB, 500MB or a number of bytes)")
    size = int(float(found.group(1)) * _UNITS[found.group(2) or ""])
    if size <= 0:
        raise ValueError(f"{text!r} is not a positive size")
    return size


def nbytes(shape, dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def plan(specs: list[tuple], max_bytes: int) -> list[list[tuple]]:
    """`specs` (name, shape, dtype), in the order they are written, split into files of at
    most `max_bytes` each (a larger tensor alone in its file)."""
    files: list[list[tuple]] = [[]]
    size = 0
    for spec in specs:
        bytes_ = nbytes(spec[1], spec[2])
        if files[-1] and size + bytes_ > max_bytes:
            files.append([])
            size = 0
        files[-1].append(spec)
        size += bytes_
    return files


def file_names(count: int) -> list[str]:
    return [SINGLE] if count == 1 else [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _header(specs: list[tuple]) -> bytes:
    header, offset = {}, 0
    for name, shape, dtype in specs:
        end = offset + nbytes(shape, dtype)
        header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


class Writer:
    """Writes the planned tensors into `folder` in the planned order, then the index."""

    def __init__(self, folder: str, specs: list[tuple], max_bytes: int):
        self.folder = folder
        self.files = plan(specs, max_bytes)
        self.names = file_names(len(self.files))
        self.order = [(i, spec) for i, specs_ in enumerate(self.files) for spec in specs_]
        self.done = 0
        self.stream = None

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Append the next tensor of the plan, which must be `name` with its planned shape and dtype."""
        if self.done == len(self.order):
            raise RuntimeError(f"megatron-async: {name} is not in the export's plan (all tensors are written)")
        index, (planned, shape, dtype) = self.order[self.done]
        if (name, tuple(tensor.shape), tensor.dtype) != (planned, tuple(shape), dtype):
            raise RuntimeError(f"megatron-async: the export wrote {name} {tuple(tensor.shape)} {tensor.dtype} where "
                               f"its plan has {planned} {tuple(shape)} {dtype}")
        if self.stream is None:
            self.stream = open(os.path.join(self.folder, self.names[index]), "wb")
            self.stream.write(_header(self.files[index]))
        data = tensor.detach().to("cpu").contiguous().reshape(-1)
        if data.numel():
            self.stream.write(data.view(torch.uint8).numpy())
        self.done += 1
        if self.done == len(self.order) or self.order[self.done][0] != index:
            self.stream.close()
            self.stream = None

    def finish(self) -> list[str]:
        """The index (where the tensors take more than one file), once every tensor is written;
        returns the files written."""
        if self.done != len(self.order):
            raise RuntimeError(f"megatron-async: the export wrote {self.done} of its {len(self.order)} tensors")
        if len(self.files) == 1:
            return list(self.names)
        specs = [spec for _, spec in self.order]
        index = {"metadata": {"total_parameters": sum(math.prod(shape) for _, shape, _ in specs),
                              "total_size": sum(nbytes(shape, dtype) for _, shape, dtype in specs)},
                 "weight_map": {spec[0]: self.names[i] for i, spec in self.order}}
        with open(os.path.join(self.folder, INDEX), "w", encoding="utf-8") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
        return [*self.names, INDEX]

    def close(self) -> None:
        """Close a file left open by a failure (the folder is removed after)."""
        if self.stream is not None:
            self.stream.close()
            self.stream = None

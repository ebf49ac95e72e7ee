"""An export that runs out of memory, as one refusal saying what it needs.

The exporter holds one group of weights at a time (the embedding, one layer, or the final
norm with the output layer: checkpoint_stream.py), so its memory is bounded by the largest
group, not the model; a process given less than that fails in torch's CPU allocator
(a RuntimeError whose text says "can't allocate memory") or in Python (MemoryError). Either
is the same thing to the user: one line, and nothing left at `--out` (hf_folder.py removes the
staging folder on any failure). Any other exception propagates as it is.
"""

from __future__ import annotations

from megatron_async.megatron_lm.export import ExportError

_ALLOCATOR = "can't allocate memory"


def refusal(out: str, exc: BaseException) -> ExportError | None:
    """The refusal for an allocation that failed during the export, or None for anything else."""
    if not (isinstance(exc, MemoryError) or (isinstance(exc, RuntimeError) and _ALLOCATOR in str(exc))):
        return None
    said = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    said = said[said.find("DefaultCPUAllocator"):] if "DefaultCPUAllocator" in said else said
    return ExportError(f"--out {out}: the export ran out of memory ({said[:200]}); nothing was written there. "
                       "It holds one group of weights at a time (the embedding, one layer, or the output layer): "
                       "run it where the process may use more than the largest group (docs/export_hf.md, "
                       "'Exporting a model larger than memory')")

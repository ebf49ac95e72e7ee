"""What glibc's malloc holds: the bytes in use and the free bytes it keeps.

RSS alone cannot tell a leak from an allocator that keeps freed memory: glibc raises
its mmap threshold as large blocks are freed, so tensors of a few hundred KB then
come from its heaps, whose free chunks stay resident. In use flat and free growing
is the allocator; in use growing is a leak of what malloc hands out (tensors' storage
among it). Python's small objects live in arenas Python maps itself, which malloc
does not count.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


@functools.lru_cache(maxsize=1)
def _mallinfo2():
    """glibc's mallinfo2 (2.33 and later), or None (another C library, an older glibc)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        function = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    function.restype = _MallInfo2
    function.argtypes = []
    return function


def heap_mb() -> dict:
    """{"heap_in_use_mb", "heap_free_mb"} over every malloc arena (blocks it mmapped
    count as in use); {} where glibc's mallinfo2 is unavailable."""
    function = _mallinfo2()
    if function is None:
        return {}
    info = function()
    return {"heap_in_use_mb": round((info.uordblks + info.hblkhd) / 1e6, 1),
            "heap_free_mb": round(info.fordblks / 1e6, 1)}

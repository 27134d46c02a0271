"""CPU allocations: let large freed tensors be reused instead of handed back to the OS.

glibc serves an allocation above its mmap threshold (adaptive, at most 32 MB by default) with
fresh pages from mmap and unmaps them on free, so every step that allocates a large tensor again
(the LM head's [tokens, vocab] logits, a long sequence's activations) page-faults on first touch.
On CPU that made the LM head's cost per token jump once its logits outgrew the threshold, a bend
no cost model linear in tokens follows; with the thresholds raised the cost per token stays flat.
The profiler and the CPU
trainer both call `reuse_large_cpu_allocations`, so the cost model is fitted to what training sees.
GPU memory has its own caching allocator and is not affected.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
_applied = False


def reuse_large_cpu_allocations(threshold_bytes: int = 1 << 30) -> bool:
    """Raise glibc's mmap and trim thresholds to `threshold_bytes`; True if in effect.

    A no-op returning False where the C library is not glibc (macOS, musl). Process-wide and
    idempotent: freed memory up to the threshold stays with the process for reuse.
    """
    global _applied
    if _applied:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    _applied = mallopt(M_MMAP_THRESHOLD, threshold_bytes) == 1 and mallopt(M_TRIM_THRESHOLD, threshold_bytes) == 1
    return _applied

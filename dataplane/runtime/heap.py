"""Keep glibc from keeping a stage process's freed buffers (Linux, glibc).

glibc serves an allocation above its mmap threshold (128 KB) with its own mapping, which a
free returns to the system. Each such free also raises the threshold to that buffer's
size, up to 32 MB, so later buffers of that size come from the heap instead, where a free
leaves a hole the process keeps. A stage computes steps of ever new shapes, and the CPU
plugin sizes its buffers by shape, so the holes add up: both stages of SmolLM2 in one
process, after prefill steps of 320 distinct lengths, held 877 MB with the moving threshold
and 668 MB with it held at 128 KB (671 MB after a ``malloc_trim`` of the former: the
difference was free heap). Holding the threshold costs a mapping per large buffer the
plugin allocates; serving 16 clients measured no change in throughput beyond the runs'
spread (docs/measurements.md, "Soak").

Best effort: on other C libraries nothing happens, and a threshold the user set with
``MALLOC_MMAP_THRESHOLD_`` is left to them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_MMAP_THRESHOLD = -3  # mallopt's parameter number in glibc's malloc.h
MMAP_THRESHOLD = 128 << 10  # glibc's own starting value


def hold_mmap_threshold(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes (which stops it moving); True if
    it was set. Call it once, early in a process that runs stages."""
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, threshold) == 1

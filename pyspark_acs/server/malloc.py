"""Allocator settings of the long-running server processes (glibc ``malloc``).

A cache server builds a large buffer for every big answer (a 1 MiB ``Get`` of 256 chunks: the
joined values, the serialized message, gRPC's copy of it) and frees it right after. glibc
serves allocations above its mmap threshold with a fresh ``mmap`` and returns them with
``munmap``, and gives memory at the top of its heap back to the kernel above its trim
threshold; either way every such buffer is faulted in page by page again, and a 1 MiB Get
spends most of its server CPU in the kernel (page faults, zeroing pages, unmapping); with the
thresholds below it is about a quarter of that. Small allocations and the cache's 4 KiB values
are not affected.

Used by the cache server's entry point only (``acs-cache-server``), never on
import: a library must not retune the allocator of the process that imports it.
"""

from __future__ import annotations

import ctypes
import logging
import sys

__all__ = [
    "tune_malloc",
]

log = logging.getLogger(__name__)

#: Allocations up to this size come from the heap (reused), not from a fresh ``mmap`` each:
#: glibc's own ceiling for its dynamic threshold on 64-bit, and above the largest gRPC message
#: the servers build in normal operation (a 1 MiB read piece, a push of at most a few MiB).
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
#: Free memory kept at the top of a heap for the next buffers instead of being returned to the
#: kernel: a server's resident memory may hold up to this much free memory per malloc arena
#: (the event loop's thread and gRPC's few threads each may use one).
TRIM_THRESHOLD_BYTES = 2 * MMAP_THRESHOLD_BYTES

# mallopt(3) parameter numbers (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def tune_malloc() -> bool:
    """Set glibc's mmap and trim thresholds for this process (see the module docstring).

    Returns whether they were set: False, and nothing changed, where the C library is not
    glibc (another OS, musl) or refuses a value.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1 and ok
    if not ok:
        log.warning("mallopt refused the mmap or trim threshold; large answers are slower")
    return ok

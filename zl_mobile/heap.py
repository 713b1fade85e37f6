"""Give freed memory back: a phone that lives for days must end a flood of large frames near the
RSS it started at (issue 31).

glibc raises its mmap threshold to the size of each large block freed (up to 32 MiB): after a
peer has sent a few 30 MiB bodies, later blocks of that size come from the heap, whose free
space is kept, not returned, and RSS stays up for good (measured: 40 bodies of 3-40 MiB left
an emulated phone 80-100 MiB larger). A fixed threshold turns that off: blocks of 4 MiB or more
are mapped and unmapped each time, and the heap is trimmed at glibc's fixed default. Hidden
states of a small model stay below it; a larger one pays a few page faults per micro-batch."""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("zl_mobile.heap")
M_MMAP_THRESHOLD = -3  # glibc malloc.h
MMAP_THRESHOLD_BYTES = 4 << 20


def fix_mmap_threshold(nbytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """mallopt(M_MMAP_THRESHOLD, nbytes); False where there is no glibc (then nothing changes)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, nbytes) == 1
    if not ok:
        log.warning("mallopt(M_MMAP_THRESHOLD, %d) failed: freed frame buffers may stay resident", nbytes)
    return ok

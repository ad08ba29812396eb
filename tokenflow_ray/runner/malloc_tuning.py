"""glibc malloc settings for CPU inference: activations come from the heap, not from fresh mmaps each step.

A step allocates and frees the same activation tensors every time (a decode GEMM's 256 KB output at batch 32, a
prefill's several MB). glibc serves blocks above its mmap threshold (128 KB at first, then adjusted to the largest
block freed) with a fresh mmap, and returns the top of the heap to the system above its trim threshold: either way
the next step's tensors fault their pages in again, which the kernel zero-fills. Measured here: a model's 24
projections at 32 rows took 2.3-2.4 ms in a fresh process against 1.6 ms with the thresholds fixed high (the same
loop after oneDNN had run, whose large frees had raised glibc's dynamic threshold, was fast too). Fixing both
thresholds keeps those pages in the process, as inference servers get from jemalloc or tcmalloc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed value on 64-bit (blocks above it are still mmapped)
TRIM_THRESHOLD = 1 << 30  # the heap's free top is kept up to this size


def tune_malloc_for_inference() -> bool:
    """Set glibc's mmap and trim thresholds (process-wide; the same values whoever calls). False where the C
    library is not glibc or refuses a value (then nothing changes)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not ok:
        log.warning("glibc refused the malloc thresholds for inference; activations may be mmapped each step")
    return ok

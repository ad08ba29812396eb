"""The runner's glibc settings: an activation-sized block comes from the heap, not from a fresh mmap."""

from __future__ import annotations

import subprocess
import sys

import pytest

# In a fresh interpreter: malloc an 8 MB block and report the bytes glibc holds in mmapped regions meanwhile.
PROBE = """
import ctypes, ctypes.util, sys
libc = ctypes.CDLL(ctypes.util.find_library("c"))
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = (ctypes.c_void_p,)
if sys.argv[1] == "tuned":
    from tokenflow_ray.runner.malloc_tuning import tune_malloc_for_inference
    assert tune_malloc_for_inference()
before = libc.mallinfo2().hblkhd
p = libc.malloc(8 << 20)
print(libc.mallinfo2().hblkhd - before)
libc.free(p)
"""


def _mmapped_bytes(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_tuned_malloc_serves_an_activation_from_the_heap():
    try:
        plain = _mmapped_bytes("plain")
    except AssertionError as exc:  # no mallinfo2 (glibc < 2.33, or not glibc)
        pytest.skip(f"mallinfo2 unavailable: {exc}")
    assert plain >= 8 << 20  # glibc's default: a fresh mmap for a block this size, faulted in on first use
    assert _mmapped_bytes("tuned") == 0  # from the heap, whose pages stay in the process between steps


def test_tuning_twice_is_harmless():
    from tokenflow_ray.runner.malloc_tuning import tune_malloc_for_inference

    first = tune_malloc_for_inference()
    assert tune_malloc_for_inference() == first

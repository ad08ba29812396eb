"""The host spill store on a CUDA machine: a plain CPU tensor of exactly its size, page-locked by host registration.

`torch.empty(..., pin_memory=True)` takes pinned memory from torch's caching host allocator, which rounds every
request up to a power of two: a 13.5 GiB store pinned 16 GiB on the H200, and a full-size 108 GiB one would pin
128 GiB of the host's RAM. `cudaHostRegister` page-locks the tensor's bytes rounded up to a whole page (vLLM's
offload pins its CPU cache the same way); `close` unregisters them. The tensor starts on a page boundary in a buffer
of its own, so the pages registered hold nothing else (a small store on the heap could otherwise share a page with
another registered range, and a second registration of a page fails). Registered memory is pinned for DMA like any other: copies to and
from it are asynchronous, and numpy views of it are ordinary CPU memory (migration reads and writes the store so).
"""

from __future__ import annotations

import logging
import mmap
from typing import Any

import torch

log = logging.getLogger(__name__)

_REGISTER_DEFAULT = 0  # cudaHostRegisterDefault: page-locked, portable over UVA like any pinned memory


def _code(err: Any) -> int:
    """A cudaError_t from torch.cuda.cudart() as an int (a pybind enum; a plain int from a stand-in)."""
    return int(getattr(err, "value", err))


class PinnedHostStore:
    """`shape` of `dtype` in page-locked host memory: `numel * element_size` bytes rounded up to a page.

    `cudart` is `torch.cuda.cudart()` (tests pass a recording stand-in)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, cudart: Any) -> None:
        numel = 1
        for n in shape:
            numel *= n
        self.nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if self.nbytes == 0:
            raise ValueError(f"PinnedHostStore: shape {shape} holds no bytes")
        page = mmap.PAGESIZE
        self.registered_bytes = -(-self.nbytes // page) * page
        # Zeroed, as the pinned store was (a few seconds for 100 GiB, beside the registration's own page-in).
        raw = torch.zeros(self.registered_bytes + page, dtype=torch.uint8)
        start = -raw.data_ptr() % page
        self.tensor = raw[start:start + self.nbytes].view(dtype).view(shape)
        self._cudart = cudart
        self._ptr = self.tensor.data_ptr()
        err = _code(cudart.cudaHostRegister(self._ptr, self.registered_bytes, _REGISTER_DEFAULT))
        if err != 0:
            raise RuntimeError(f"cudaHostRegister of the {self.nbytes / 2**30:.2f} GiB host KV store failed "
                               f"(cudaError {err}): is the locked-memory limit (ulimit -l) too low?")
        self.registered = True
        log.info("host KV store: %.2f GiB page-locked by registration", self.registered_bytes / 2**30)

    def close(self) -> None:
        """Unregister (once). The caller has made sure no copy touches the store any more."""
        if not self.registered:
            return
        self.registered = False
        err = _code(self._cudart.cudaHostUnregister(self._ptr))
        if err != 0:
            log.warning("cudaHostUnregister of the host KV store failed (cudaError %d)", err)

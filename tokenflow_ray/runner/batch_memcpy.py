"""`cuMemcpyBatchAsync` (CUDA driver >= 12.8): many host<->device copies in one driver call on one stream.

Resolved through `cuda.bindings` (cuda-python, in the GPU image) with `cuGetProcAddress` at the CUDA 12.8 ABI, the
signature with a `failIdx` out-parameter, which every later driver still serves under that version (CUDA 13 added a
`_v2` without it), and called through ctypes with numpy arrays of addresses, as vLLM's simple CPU offload does.
Every copy carries `srcAccessOrder = STREAM`: the source is read in stream order, after the work the stream waits
for (the model's KV writes, an earlier step's copy into a host block), never earlier.

Known hazards, each answered here rather than discovered on the GPU:
- registered (not cudaHostAlloc'ed) host memory faults in the batch call where the device cannot use host pointers
  for it (sglang#40232): the batch path is used only when CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM is 1;
- some driver/GPU pairs mishandle it (crashes on sm_100, vllm#49276): off for compute capability >= 10;
- `attrsIdxs` is read as `numAttrs` entries by the documentation and as `count` entries by some readers of it: we
  pass `count` zeros, correct under either reading;
- anything else: `cuda_copies.CudaBlockCopier` runs a self-check at start (a batched round trip through the real
  host store, compared byte for byte) and falls back to per-block copies on any error or mismatch.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from tokenflow_ray.runner.copy_plan import Descriptors

_ABI_VERSION = 12080  # cuMemcpyBatchAsync(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, failIdx, stream)
_SRC_ACCESS_ORDER_STREAM = 1


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):  # CUmemcpyAttributes
    _fields_ = [("srcAccessOrder", ctypes.c_uint), ("srcLocHint", _MemLocation), ("dstLocHint", _MemLocation),
                ("flags", ctypes.c_uint)]


_FN_TYPE = ctypes.CFUNCTYPE(ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p)


class BatchMemcpyError(RuntimeError):
    pass


class DriverBatchMemcpy:
    """Callable: `(descriptors, stream_handle)` enqueues every copy on that stream (a created stream, not the
    legacy default one) and returns; raises BatchMemcpyError when the driver refuses the batch."""

    name = "cuMemcpyBatchAsync"

    def __init__(self, fn) -> None:
        self._fn = fn
        self._attrs = _MemcpyAttributes(srcAccessOrder=_SRC_ACCESS_ORDER_STREAM)
        self._idx = np.zeros(0, dtype=np.uint64)

    def __call__(self, batch: Descriptors, stream_handle: int) -> None:
        n = len(batch)
        if n == 0:
            return
        if len(self._idx) < n:
            self._idx = np.zeros(max(n, 2 * len(self._idx)), dtype=np.uint64)
        dsts = np.ascontiguousarray(batch.dsts, dtype=np.uint64)
        srcs = np.ascontiguousarray(batch.srcs, dtype=np.uint64)
        sizes = np.ascontiguousarray(batch.sizes, dtype=np.uint64)
        fail = ctypes.c_size_t(0)
        err = self._fn(dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, n, ctypes.addressof(self._attrs),
                       self._idx.ctypes.data, 1, ctypes.byref(fail), stream_handle)
        if err != 0:
            raise BatchMemcpyError(f"cuMemcpyBatchAsync: CUresult {err} at copy {fail.value} of {n}")


@dataclass(frozen=True)
class Resolved:
    memcpy: DriverBatchMemcpy | None
    why: str  # what was found, or why the batch call is not used


def resolve_driver_batch_memcpy(device_index: int) -> Resolved:
    """The driver's batch copy for this device, or None with the reason (no cuda-python, an old driver, ...)."""
    try:
        from cuda.bindings import driver as drv
    except ImportError as exc:
        return Resolved(None, f"cuda.bindings not importable ({exc})")
    ok = drv.CUresult.CUDA_SUCCESS
    try:
        err, version = drv.cuDriverGetVersion()
        if err != ok or version < _ABI_VERSION:
            return Resolved(None, f"driver CUDA version {version} < 12.8")
        attrs = drv.CUdevice_attribute
        checks = {"host pointers for registered memory":
                  attrs.CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM,
                  "compute capability major": attrs.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR}
        values = {}
        for name, attr in checks.items():
            err, values[name] = drv.cuDeviceGetAttribute(attr, device_index)
            if err != ok:
                return Resolved(None, f"cuDeviceGetAttribute({name}) failed: {err}")
        if values["host pointers for registered memory"] != 1:
            return Resolved(None, "the device cannot use host pointers for registered memory")
        if values["compute capability major"] >= 10:
            return Resolved(None, "compute capability >= 10 (batch copies reported to crash there)")
        err, ptr, _ = drv.cuGetProcAddress(b"cuMemcpyBatchAsync", _ABI_VERSION, 0)
        if err != ok or not int(ptr):
            return Resolved(None, f"cuGetProcAddress(cuMemcpyBatchAsync) failed: {err}")
    except Exception as exc:  # noqa: BLE001 - any binding mismatch means: per-block copies
        return Resolved(None, f"cuda.bindings call failed: {type(exc).__name__}: {exc}")
    return Resolved(DriverBatchMemcpy(_FN_TYPE(int(ptr))), f"driver {version // 1000}.{version % 1000 // 10}")

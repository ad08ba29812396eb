"""The cuMemcpyBatchAsync binding without a GPU: a stand-in `cuda.bindings.driver` hands out the address of a C
callback (a ctypes function with the driver's 12.8 signature), so the resolved call goes through a real C function
pointer and the test reads back exactly what the driver would receive."""

from __future__ import annotations

import ctypes
import sys
import types
from enum import IntEnum

import numpy as np
import pytest

from tokenflow_ray.runner import batch_memcpy as bm
from tokenflow_ray.runner.copy_plan import Descriptors


class _Recorder:
    def __init__(self, result: int = 0) -> None:
        self.result, self.calls = result, []
        self.fn = bm._FN_TYPE(self._called)  # kept alive here: the driver stand-in hands out its address

    def _called(self, dsts, srcs, sizes, count, attrs, attr_idxs, num_attrs, fail_idx, stream):
        def read(p):
            return np.ctypeslib.as_array(ctypes.cast(p, ctypes.POINTER(ctypes.c_uint64)), (count,)).copy()

        attr = ctypes.cast(attrs, ctypes.POINTER(bm._MemcpyAttributes)).contents
        self.calls.append(dict(dsts=read(dsts), srcs=read(srcs), sizes=read(sizes), count=count,
                               order=attr.srcAccessOrder, flags=attr.flags, idxs=read(attr_idxs),
                               num_attrs=num_attrs, stream=stream))
        if self.result:
            ctypes.cast(fail_idx, ctypes.POINTER(ctypes.c_size_t)).contents.value = 1
        return self.result

    @property
    def address(self) -> int:
        return ctypes.cast(self.fn, ctypes.c_void_p).value


def _fake_driver(monkeypatch, recorder, version=13000, host_pointers=1, major=9, proc_err=0):
    drv = types.ModuleType("cuda.bindings.driver")
    drv.CUresult = IntEnum("CUresult", {"CUDA_SUCCESS": 0, "CUDA_ERROR_INVALID_VALUE": 1}, start=0)
    drv.CUdevice_attribute = IntEnum("CUdevice_attribute", {
        "CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM": 91,
        "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR": 75})
    values = {91: host_pointers, 75: major}
    drv.cuDriverGetVersion = lambda: (drv.CUresult.CUDA_SUCCESS, version)
    drv.cuDeviceGetAttribute = lambda attr, dev: (drv.CUresult.CUDA_SUCCESS, values[int(attr)])
    drv.cuGetProcAddress = lambda name, ver, flags: (
        drv.CUresult(proc_err), recorder.address if name == b"cuMemcpyBatchAsync" and ver == 12080 else 0, 0)
    bindings = types.ModuleType("cuda.bindings")
    bindings.driver = drv
    cuda = types.ModuleType("cuda")
    cuda.bindings = bindings
    for name, module in (("cuda", cuda), ("cuda.bindings", bindings), ("cuda.bindings.driver", drv)):
        monkeypatch.setitem(sys.modules, name, module)


def _batch(n):
    ids = np.arange(n, dtype=np.uint64)
    return Descriptors((1 << 20) + ids * 4096, ids * 8192, np.full(n, 4096, dtype=np.uint64))


def test_the_attributes_struct_has_the_driver_layout():
    assert ctypes.sizeof(bm._MemcpyAttributes) == 24  # order, two (type, id) locations, flags: 4-byte fields


def test_the_resolved_call_passes_the_driver_what_it_expects(monkeypatch):
    recorder = _Recorder()
    _fake_driver(monkeypatch, recorder)
    resolved = bm.resolve_driver_batch_memcpy(0)
    assert resolved.memcpy is not None and resolved.why == "driver 13.0"
    for n in (3, 40):  # the attrsIdxs array grows with the batch
        resolved.memcpy(_batch(n), 0xABC)
    for call, n in zip(recorder.calls, (3, 40)):
        batch = _batch(n)
        assert call["count"] == n and call["stream"] == 0xABC and call["num_attrs"] == 1
        assert (call["dsts"] == batch.dsts).all() and (call["srcs"] == batch.srcs).all()
        assert (call["sizes"] == batch.sizes).all()
        assert call["order"] == 1 and call["flags"] == 0  # srcAccessOrder STREAM
        assert (call["idxs"] == 0).all()  # every copy under attrs[0], whichever way attrsIdxs is read
    resolved.memcpy(_batch(0), 0xABC)
    assert len(recorder.calls) == 2  # an empty batch is no call


def test_a_refused_batch_raises_with_the_failing_copy(monkeypatch):
    recorder = _Recorder(result=1)
    _fake_driver(monkeypatch, recorder)
    with pytest.raises(bm.BatchMemcpyError, match="CUresult 1 at copy 1 of 3"):
        bm.resolve_driver_batch_memcpy(0).memcpy(_batch(3), 1)


@pytest.mark.parametrize("kw, why", [
    (dict(version=12060), "12.8"), (dict(host_pointers=0), "host pointers"), (dict(major=10), "compute capability"),
    (dict(proc_err=1), "cuGetProcAddress")])
def test_not_used_where_it_is_known_not_to_work(monkeypatch, kw, why):
    _fake_driver(monkeypatch, _Recorder(), **kw)
    resolved = bm.resolve_driver_batch_memcpy(0)
    assert resolved.memcpy is None and why in resolved.why


def test_without_cuda_python_the_reason_is_given(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda", None)
    resolved = bm.resolve_driver_batch_memcpy(0)
    assert resolved.memcpy is None and "cuda.bindings" in resolved.why

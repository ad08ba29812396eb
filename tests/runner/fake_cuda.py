"""Recording stand-ins for `torch.cuda` and the driver's batch copy, so the CUDA copy path runs on CPU tensors.

`FakeCuda.log` records stream waits, event records, host waits and batch calls in order. `RecordingBatchMemcpy`
performs each (dst, src, size) triple with `ctypes.memmove` on the CPU tensors' real memory, after checking that
one side lies inside registered host memory (the host store) and the other inside the device pool it was given (a
wrong address fails the test instead of corrupting memory; the copier's start-up self-check, its first two calls,
uses scratch tensors of its own on the device side).
With `defer=True` a batch lands only when its stream is synchronised or waited on, as a GPU's copies land some time
after the call returns: a host access that does not settle first then sees (or is overwritten by) a late copy.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools

import torch


class FakeCuda:
    def __init__(self) -> None:
        self.log: list[tuple] = []
        self._ids = itertools.count(1)
        self.streams: dict[int, _Stream] = {}
        self.compute = self.Stream(name="compute")
        self.runtime = FakeCudart(self.log)

    def Stream(self, device=None, name=None):  # noqa: N802 (torch.cuda's names)
        s = _Stream(self, name or f"side{len(self.streams)}", next(self._ids))
        self.streams[s.cuda_stream] = s
        return s

    def Event(self, enable_timing=False):  # noqa: N802
        return _Event(self, next(self._ids))

    def current_stream(self, device=None):
        return self.compute

    def cudart(self):
        return self.runtime

    @contextlib.contextmanager
    def stream(self, s):
        self.log.append(("enter", s.name))
        yield
        self.log.append(("exit", s.name))


class FakeCudart:
    """cudaHostRegister / cudaHostUnregister, recorded; `fail` makes registration return that error code."""

    def __init__(self, log: list) -> None:
        self.log, self.fail, self.registered = log, 0, {}

    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802
        self.log.append(("host_register", ptr, size, flags))
        if not self.fail:
            self.registered[ptr] = size
        return self.fail

    def cudaHostUnregister(self, ptr):  # noqa: N802
        self.log.append(("host_unregister", ptr))
        return 0 if self.registered.pop(ptr, None) is not None else 1


class _Stream:
    def __init__(self, cuda, name, handle):
        self.cuda, self.name, self.cuda_stream = cuda, name, handle
        self.pending: list = []  # deferred batch copies

    def wait_stream(self, other):
        other.land()  # whatever `self` runs next comes after `other`'s work so far
        self.cuda.log.append(("wait", self.name, other.name))

    def synchronize(self):
        self.land()
        self.cuda.log.append(("stream_sync", self.name))

    def land(self):
        for copy in self.pending:
            copy()
        self.pending = []


class _Event:
    def __init__(self, cuda, i):
        self.cuda, self.i, self.stream = cuda, i, None

    def record(self, stream):
        self.stream = stream
        self.cuda.log.append(("record", self.i, stream.name))

    def synchronize(self):
        self.stream.land()
        self.cuda.log.append(("host_sync", self.i, self.stream.name))

    def query(self):
        return True

    def elapsed_time(self, end):
        return 1.0 + end.i - self.i


class RecordingBatchMemcpy:
    """The batch call on CPU memory. `calls`: (stream name, triples, bytes) per call; `fail_on`: call numbers
    (1-based) that raise instead; `corrupt`: drop each batch's last triple (a wrong binding)."""

    name = "recording stand-in"

    def __init__(self, cuda: FakeCuda, pool: torch.Tensor, defer: bool = False, fail_on=(),
                 corrupt: bool = False) -> None:
        self.cuda, self.defer, self.fail_on, self.corrupt = cuda, defer, set(fail_on), corrupt
        self.pool = (pool.data_ptr(), pool.data_ptr() + pool.numel() * pool.element_size())
        self.calls: list[tuple[str, int, int]] = []
        self.count = 0

    def _check(self, d: int, s: int, n: int) -> None:
        host = [(p, p + size) for p, size in self.cuda.runtime.registered.items()]
        device = [self.pool] if self.count > 2 else None  # the self-check's scratch is the copier's own

        def inside(ptr, regions):
            return regions is None or any(lo <= ptr and ptr + n <= hi for lo, hi in regions)

        assert (inside(d, host) and inside(s, device)) or (inside(s, host) and inside(d, device)), \
            f"a copy of {n} B from {s:#x} to {d:#x} is not between the host store and the pool"

    def __call__(self, batch, stream_handle):
        self.count += 1
        if self.count in self.fail_on:
            raise RuntimeError("stand-in: the batch call fails")
        stream = self.cuda.streams[stream_handle]
        triples = list(zip(batch.dsts.tolist(), batch.srcs.tolist(), batch.sizes.tolist()))
        for d, s, n in triples:
            self._check(d, s, n)
        self.calls.append((stream.name, len(triples), sum(n for _, _, n in triples)))
        self.cuda.log.append(("batch", stream.name, len(triples)))
        if self.corrupt:
            triples = triples[:-1]

        def run():
            for d, s, n in triples:
                ctypes.memmove(d, s, n)

        if self.defer:
            stream.pending.append(run)
        else:
            run()


class NoNumpy(torch.Tensor):
    """A CPU tensor that refuses `.numpy()`, as a CUDA tensor does: the pool of a test that must never view it."""

    def numpy(self, *args, **kwargs):
        raise TypeError("this pool stands for a CUDA tensor: no numpy view")

"""The CUDA copy path's logic on CPU: a recording stand-in for torch.cuda checks that the evict and load streams
wait for the compute stream (and loads for evicts) before copying, that launch never blocks the host, that the join
orders the next compute after both side streams on the device and waits on the host only for the tails' events,
and that per-block copies through the block-major host pool round-trip the KV."""

from __future__ import annotations

import contextlib
import itertools

import torch

from tokenflow_ray.engine.plan import BlockCopy, StepPlan
from tokenflow_ray.runner.cuda_copies import CudaBlockCopier
from tokenflow_ray.runner.kv_pool import KVPool


class FakeCuda:
    def __init__(self) -> None:
        self.log: list[tuple] = []
        self._ids = itertools.count()
        self.compute = self.Stream(name="compute")

    def Stream(self, device=None, name=None):  # noqa: N802 (torch.cuda's names)
        return _Stream(self, name or f"side{next(self._ids)}")

    def Event(self, enable_timing=False):  # noqa: N802
        return _Event(self, next(self._ids))

    def current_stream(self, device=None):
        return self.compute

    @contextlib.contextmanager
    def stream(self, s):
        self.log.append(("enter", s.name))
        yield
        self.log.append(("exit", s.name))


class _Stream:
    def __init__(self, cuda, name):
        self.cuda, self.name = cuda, name

    def wait_stream(self, other):
        self.cuda.log.append(("wait", self.name, other.name))


class _Event:
    def __init__(self, cuda, i):
        self.cuda, self.i, self.stream = cuda, i, None

    def record(self, stream):
        self.stream = stream.name
        self.cuda.log.append(("record", self.i, stream.name))

    def synchronize(self):
        self.cuda.log.append(("host_sync", self.i, self.stream))

    def query(self):
        return True

    def elapsed_time(self, end):
        return 1.0 + end.i - self.i


def test_ordering_and_roundtrip():
    cuda = FakeCuda()
    pool = KVPool(2, 12, 4, 2, 8, torch.float32, torch.device("cpu"), layout="block_major")
    pool.tensor.normal_()
    kv = pool.tensor
    copier = CudaBlockCopier(pool, num_host_blocks=8, cuda=cuda, pin_memory=False)
    evict, load = copier.evict_stream.name, copier.load_stream.name
    out = StepPlan(0, write_through=(BlockCopy("a", 0, 0),),
                   swap_out=(BlockCopy("b", 3, 3), BlockCopy("b", 4, 4), BlockCopy("c", 5, 5)))
    handle = copier.launch(out)
    launch_log = list(cuda.log)
    assert launch_log[0] == ("wait", evict, "compute")  # before any copy on the evict stream
    assert not any(e[0] == "host_sync" for e in launch_log)  # launch never blocks the host
    tail_records = [e for e in launch_log if e[0] == "record" and e[1] in {h.i for h in handle.tails.values()}]
    assert [e[2] for e in tail_records] == [evict, evict] and list(handle.tails) == ["c", "b"]  # shortest first
    timing = copier.join(handle)
    join_log = cuda.log[len(launch_log):]
    assert ("wait", "compute", evict) in join_log and ("wait", "compute", load) in join_log
    synced = {e[1] for e in join_log if e[0] == "host_sync"}
    assert synced == {h.i for h in handle.tails.values()}  # the host waits for the tails only
    assert set(timing.swap_out_done) == {"b", "c"} and timing.num_blocks == 4 and timing.copy_s > 0
    for c in (*out.write_through, *out.swap_out):
        assert torch.equal(copier.host_kv[c.host_block], kv[c.device_block])

    cuda.log.clear()
    back = StepPlan(1, swap_in=tuple(BlockCopy("b", 8 + i, h) for i, h in enumerate((3, 4, 5, 0))))
    copier.join(copier.launch(back))
    assert ("wait", load, "compute") in cuda.log and ("wait", load, evict) in cuda.log
    first_load_record = next(i for i, e in enumerate(cuda.log) if e[0] == "record" and e[2] == load)
    assert cuda.log.index(("wait", load, evict)) < first_load_record  # host blocks written before they are read
    assert torch.equal(kv[8:11], kv[3:6]) and torch.equal(kv[11], kv[0])

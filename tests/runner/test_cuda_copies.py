"""The CUDA copy path's logic on CPU, through recording stand-ins for torch.cuda and the driver's batch copy
(tests/runner/fake_cuda.py): the moved bytes are exact (both pool layouts, both directions, bf16 and fp32, batched
and per block); a step makes a fixed number of copy calls however many blocks it moves; the side streams wait for
the compute stream and for each other before copying, launch never blocks the host, the join orders the next
compute after both side streams on the device and waits on the host only for the tails; the batched path falls
back to per-block copies when its self-check or a call fails."""

from __future__ import annotations

import random

import pytest
import torch
from torch.overrides import TorchFunctionMode

from tests.runner.fake_cuda import FakeCuda, RecordingBatchMemcpy
from tokenflow_ray.engine.plan import BlockCopy, StepPlan
from tokenflow_ray.runner.cuda_copies import CudaBlockCopier
from tokenflow_ray.runner.kv_pool import KVPool


def _copier(layout="block_major", dtype=torch.float32, blocks=64, host=64, path="batch", **batch_kw):
    cuda = FakeCuda()
    pool = KVPool(3, blocks, 4, 2, 8, dtype, torch.device("cpu"), layout=layout)
    pool.tensor.copy_(torch.randn(pool.tensor.shape))
    batch = RecordingBatchMemcpy(cuda, pool.tensor, **batch_kw) if path == "batch" else None
    copier = CudaBlockCopier(pool, num_host_blocks=host, cuda=cuda, batch_memcpy=batch)
    assert copier.path == path
    cuda.log.clear()
    if batch is not None:
        batch.calls.clear()  # the self-check's
    return copier, cuda, batch


class CountCopies(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.n += func is torch.Tensor.copy_
        return func(*args, **(kwargs or {}))


def _plan(step, n, rng, start=0):
    """n scattered blocks: write-through for half, swap-out tails of three streams for the rest."""
    dev = rng.sample(range(start, start + 32), n) if n <= 32 else list(range(start, start + n))
    host = rng.sample(range(64), n)
    copies = [BlockCopy(f"s{i % 3}", d, h) for i, (d, h) in enumerate(zip(dev, host))]
    return StepPlan(step, write_through=tuple(copies[: n // 2]), swap_out=tuple(copies[n // 2:]))


@pytest.mark.parametrize("path", ["batch", "per_block"])
@pytest.mark.parametrize("layout", ["block_major", "layer_major"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_moved_bytes_are_exact_both_directions(path, layout, dtype):
    copier, _, _ = _copier(layout, dtype, path=path)
    pool, rng = copier.pool, random.Random(0)
    out = _plan(0, 12, rng)
    copier.join(copier.launch(out))
    for c in (*out.write_through, *out.swap_out):
        assert torch.equal(copier.host_kv[c.host_block], pool.block(c.device_block))
    loads = tuple(BlockCopy("s0", 40 + i, c.host_block) for i, c in enumerate((*out.write_through, *out.swap_out)))
    before = pool.tensor.clone()
    copier.join(copier.launch(StepPlan(1, swap_in=loads)))
    for c, src in zip(loads, (*out.write_through, *out.swap_out)):
        assert torch.equal(pool.block(c.device_block), pool.block(src.device_block))
    loaded = {c.device_block for c in loads}
    assert all(torch.equal(pool.block(b), before[b] if pool.block_major else before[:, :, b])
               for b in range(64) if b not in loaded)  # nothing else written


@pytest.mark.parametrize("layout", ["block_major", "layer_major"])
def test_copy_calls_a_step_do_not_grow_with_its_blocks(layout):
    calls = {}
    for n in (2, 8, 32):
        copier, cuda, batch = _copier(layout, path="batch")
        rng = random.Random(n)
        out = _plan(0, n, rng)
        loads = StepPlan(1, swap_in=tuple(BlockCopy("x", 40 + i, 63 - i) for i in range(min(n, 24))))
        with CountCopies() as counted:
            copier.join(copier.launch(out))
            copier.join(copier.launch(loads))
        assert counted.n == 0  # no per-block copy_
        calls[n] = [(stream, triples > 0) for stream, triples, _ in batch.calls]
        assert sum(nbytes for _, _, nbytes in batch.calls) == (n + min(n, 24)) * copier.block_bytes
    evict, load = copier.evict_stream.name, copier.load_stream.name
    # Tails, write-through (evict stream), loads (load stream): one call each, for 2 blocks as for 32.
    assert calls[2] == calls[8] == calls[32] == [(evict, True), (evict, True), (load, True)]


def test_per_block_fallback_copies_a_run_of_blocks_at_once():
    copier, _, _ = _copier(path="per_block")
    run = StepPlan(0, write_through=tuple(BlockCopy("a", 10 + i, 20 + i) for i in range(8)))
    scattered = StepPlan(1, write_through=tuple(BlockCopy("a", 30 + 2 * i, i) for i in range(8)))
    for plan, expect in ((run, 1), (scattered, 8)):
        with CountCopies() as counted:
            copier.join(copier.launch(plan))
        assert counted.n == expect
    assert all(torch.equal(copier.host_kv[20 + i], copier.pool.block(10 + i)) for i in range(8))


@pytest.mark.parametrize("path", ["batch", "per_block"])
def test_stream_order_and_host_waits(path):
    copier, cuda, _ = _copier(path=path)
    evict, load = copier.evict_stream.name, copier.load_stream.name
    out = StepPlan(0, write_through=(BlockCopy("a", 0, 0),),
                   swap_out=(BlockCopy("b", 3, 3), BlockCopy("b", 4, 4), BlockCopy("c", 5, 5)))
    handle = copier.launch(out)
    launch_log = list(cuda.log)
    assert launch_log[:2] == [("wait", evict, "compute"), ("wait", evict, load)]  # before any copy
    assert not any(e[0] in ("host_sync", "stream_sync") for e in launch_log)  # launch never blocks the host
    tail_events = {id(e): e for e in handle.tails.values()}
    assert list(handle.tails) == ["c", "b"]  # shortest first
    assert len(tail_events) == (1 if path == "batch" else 2)  # a batch has no order inside: one event for all
    timing = copier.join(handle)
    join_log = cuda.log[len(launch_log):]
    assert ("wait", "compute", evict) in join_log and ("wait", "compute", load) in join_log
    synced = [e[1] for e in join_log if e[0] == "host_sync"]
    assert sorted(synced) == sorted(e.i for e in tail_events.values())  # the host waits for the tails only
    assert set(timing.swap_out_done) == {"b", "c"} and timing.num_blocks == 4 and timing.copy_s > 0

    cuda.log.clear()
    copier.join(copier.launch(StepPlan(1, swap_in=(BlockCopy("b", 8, 3), BlockCopy("b", 9, 4)))))
    # The next step's copies start after this one's on both side streams (and after the compute), before any copy
    # of its own; loads do not wait for this step's evictions (none shares a block), so both directions run at once.
    before_copies = cuda.log[:cuda.log.index(("enter", evict))]
    assert before_copies == [("wait", evict, "compute"), ("wait", evict, load), ("wait", load, "compute"),
                             ("wait", load, evict)]
    assert ("wait", load, evict) not in cuda.log[len(before_copies):]


def test_loads_wait_for_evictions_of_the_same_block():
    copier, cuda, _ = _copier()
    evict, load = copier.evict_stream.name, copier.load_stream.name
    plan = StepPlan(0, write_through=(BlockCopy("a", 1, 7),), swap_in=(BlockCopy("b", 2, 7),))
    copier.join(copier.launch(plan))
    evict_end = max(i for i, e in enumerate(cuda.log) if e[0] == "record" and e[2] == evict)
    last_wait = max(i for i, e in enumerate(cuda.log) if e == ("wait", load, evict))
    assert last_wait > evict_end  # the load of host block 7 waits for this step's write into it
    assert torch.equal(copier.pool.block(2), copier.pool.block(1))


def test_a_failing_batch_call_falls_back_to_per_block_copies(caplog):
    copier, _, batch = _copier(fail_on={4})  # calls 1-2 are the self-check
    pool, rng = copier.pool, random.Random(1)
    for step in range(3):
        plan = _plan(step, 10, rng)
        copier.join(copier.launch(plan))
        for c in (*plan.write_through, *plan.swap_out):
            assert torch.equal(copier.host_kv[c.host_block], pool.block(c.device_block))
    assert copier.path == "per_block" and batch.count == 4
    assert "per-block copies from now on" in caplog.text


def test_a_batch_call_that_fails_its_self_check_is_not_used(caplog):
    cuda = FakeCuda()
    pool = KVPool(2, 8, 4, 2, 8, torch.float32, torch.device("cpu"), layout="block_major")
    wrong = RecordingBatchMemcpy(cuda, pool.tensor, corrupt=True)
    copier = CudaBlockCopier(pool, num_host_blocks=4, cuda=cuda, batch_memcpy=wrong)
    assert copier.path == "per_block" and wrong.count == 1
    assert "self-check" in caplog.text


def test_bad_block_ids_are_refused():
    copier, _, _ = _copier()
    with pytest.raises(ValueError, match="outside"):
        copier.launch(StepPlan(0, write_through=(BlockCopy("a", 0, 64),)))
    with pytest.raises(ValueError, match="twice"):
        copier.launch(StepPlan(0, write_through=(BlockCopy("a", 0, 5), BlockCopy("b", 1, 5))))


def test_settle_waits_for_both_side_streams_and_close_unregisters():
    copier, cuda, _ = _copier()
    ptr, size = copier.host_kv.data_ptr(), copier.host_kv.numel() * copier.host_kv.element_size()
    assert cuda.runtime.registered == {ptr: size}
    copier.settle()
    assert {e[1] for e in cuda.log if e[0] == "stream_sync"} == {copier.evict_stream.name, copier.load_stream.name}
    copier.close()
    assert cuda.runtime.registered == {} and cuda.log[-1] == ("host_unregister", ptr)


@pytest.mark.parametrize("path", ["batch", "per_block"])
def test_runs_of_consecutive_blocks_move_as_one_exact_copy(path):
    copier, _, batch = _copier(path=path)
    pool = copier.pool
    run = tuple(BlockCopy("a", 10 + i, 30 + i) for i in range(6))  # one run on both sides
    broken = (BlockCopy("a", 20, 40), BlockCopy("a", 21, 42), BlockCopy("a", 23, 43))  # no run: host, then device
    plan = StepPlan(0, write_through=run + broken)
    with CountCopies() as counted:
        copier.join(copier.launch(plan))
    for c in plan.write_through:
        assert torch.equal(copier.host_kv[c.host_block], pool.block(c.device_block))
    if path == "batch":
        assert [triples for _, triples, _ in batch.calls] == [4]  # the run, then three single blocks
    else:
        assert counted.n == 4
    assert not torch.equal(copier.host_kv[41], pool.block(20)) and not torch.equal(copier.host_kv[36], pool.block(16))


@pytest.mark.parametrize("path", ["cpu", "per_block"])
def test_the_bandwidth_check_for_a_gpu_session_runs_and_moves_exact_bytes(path):
    from tokenflow_ray.runner.kv_copy_check import kv_copy_directions

    out = kv_copy_directions("cpu", blocks=4, layers=2, block_size=4, kv_heads=2, head_dim=8, batch_memcpy=None,
                             repeats=2, cuda=FakeCuda() if path == "per_block" else None)
    assert out["exact"] and out["path"] == path and out["blocks"] == 4
    assert all(out[f"{d}_gb_s"] > 0 and out[f"{d}_launch_ms"] >= 0 for d in ("d2h", "h2d", "both"))


def test_the_environment_can_force_per_block_copies(monkeypatch):
    cuda = FakeCuda()
    pool = KVPool(2, 8, 4, 2, 8, torch.float32, torch.device("cpu"), layout="block_major")
    monkeypatch.setenv("TOKENFLOW_KV_COPY", "per_block")
    assert CudaBlockCopier(pool, 4, cuda=cuda).path == "per_block"
    monkeypatch.setenv("TOKENFLOW_KV_COPY", "fast")
    with pytest.raises(ValueError, match="TOKENFLOW_KV_COPY"):
        CudaBlockCopier(pool, 4, cuda=cuda)
    monkeypatch.setenv("TOKENFLOW_KV_COPY", "auto")
    assert CudaBlockCopier(pool, 4, cuda=cuda).path == "per_block"  # auto on a CPU pool: no driver call

"""The flat gradient sync (scaling.grad_sync="flat") on two real gloo processes: averages, DDP's unused rules."""

import datetime
import queue
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RANK_TIMEOUT = datetime.timedelta(seconds=60)  # a rank whose peer never comes gives up instead of waiting forever


def _rank(rank: int, init_method: str, out) -> None:
    from tokenflow_ray.tokenizer.training.grad_sync import average_grads, broadcast_params, start_average

    # A FileStore, not MASTER_PORT: a port picked free in advance can be taken by anyone before rank 0 binds it.
    # gloo's own connections then bind ports the OS chooses and exchange them through the store.
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2, timeout=RANK_TIMEOUT)
    try:
        torch.manual_seed(rank)  # different weights per rank until the broadcast
        module = torch.nn.Linear(3, 2)
        broadcast_params([module])
        both, only_rank0, nowhere = (torch.nn.Parameter(torch.zeros(4)) for _ in range(3))
        both.grad = torch.full((4,), float(rank + 1))  # 1 and 2: average 1.5
        if rank == 0:
            only_rank0.grad = torch.full((4,), 4.0)  # (4 + 0) / 2
        average_grads([both, only_rank0, nowhere])
        # bf16 on the wire: the same rules; these values are exact in bfloat16, and the gradients stay fp32
        b16 = torch.nn.Parameter(torch.zeros(3))
        b16.grad = torch.full((3,), 3.0 * (rank + 1))  # 3 and 6: average 4.5
        pending = start_average([b16], compress="bf16")
        pending.wait()
        # As numpy: a tensor on torch's queue is shared memory whose fd the reader fetches from this process, which may
        # have exited by then (FileNotFoundError on its listener socket).
        out.put((rank, *(None if t is None else t.detach().numpy()
                         for t in (module.weight, both.grad, only_rank0.grad, nowhere.grad, b16.grad))))
    finally:
        dist.destroy_process_group()


def _results(procs, out, timeout_s: float) -> list:
    """One result per rank; fails as soon as a rank has died instead of waiting out the deadline."""
    results, deadline = [], time.monotonic() + timeout_s
    while len(results) < len(procs):
        try:
            results.append(out.get(timeout=0.5))
        except queue.Empty:
            failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            assert not failed, f"rank(s) exited early (rank, exit code): {failed}"
            assert time.monotonic() < deadline, f"no results after {timeout_s:.0f} s"
    by_rank = sorted(results, key=lambda r: r[0])
    return [(r, *(None if a is None else torch.from_numpy(a) for a in arrays)) for r, *arrays in by_rank]


def test_flat_sync_averages_like_ddp(tmp_path):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, f"file://{tmp_path / 'store'}", out)) for r in range(2)]
    try:
        for p in procs:
            p.start()
        results = _results(procs, out, timeout_s=2 * RANK_TIMEOUT.total_seconds())
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0
    finally:  # whatever failed: a rank left waiting for its peer would hang pytest's exit (multiprocessing joins it)
        for p in (p for p in procs if p.pid is not None):  # the started ones
            if p.exitcode is None:
                p.kill()
            p.join()
    (_, w0, both0, only0, none0, b0), (_, w1, both1, only1, none1, b1) = results
    for b in (b0, b1):
        assert b.dtype == torch.float32 and torch.equal(b, torch.full((3,), 4.5))
    assert torch.equal(w0, w1)  # rank 0's weights everywhere
    for both, only, nowhere in ((both0, only0, none0), (both1, only1, none1)):
        assert torch.equal(both, torch.full((4,), 1.5))
        assert torch.equal(only, torch.full((4,), 2.0))  # unused on rank 1: it contributed zeros, got the average
        assert nowhere is None  # unused on every rank: no gradient, so Adam skips it

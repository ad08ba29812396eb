"""The flat gradient sync (scaling.grad_sync="flat") on two real gloo processes: averages, DDP's unused rules."""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, out) -> None:
    from tokenflow_ray.tokenizer.training.grad_sync import average_grads, broadcast_params, start_average

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
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
        out.put((rank, module.weight.detach().clone(), both.grad.clone(), only_rank0.grad.clone(), nowhere.grad,
                 b16.grad.clone()))
    finally:
        dist.destroy_process_group()


def test_flat_sync_averages_like_ddp():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    (_, w0, both0, only0, none0, b0), (_, w1, both1, only1, none1, b1) = results
    for b in (b0, b1):
        assert b.dtype == torch.float32 and torch.equal(b, torch.full((3,), 4.5))
    assert torch.equal(w0, w1)  # rank 0's weights everywhere
    for both, only, nowhere in ((both0, only0, none0), (both1, only1, none1)):
        assert torch.equal(both, torch.full((4,), 1.5))
        assert torch.equal(only, torch.full((4,), 2.0))  # unused on rank 1: it contributed zeros, got the average
        assert nowhere is None  # unused on every rank: no gradient, so Adam skips it

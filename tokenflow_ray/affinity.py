"""Pinning a worker to CPUs of its own: a Train worker's loop (tokenizer scaling.pin_cpus), or a whole serving
replica's process (ServeConfig.pin_cpus).

With one torch thread per worker and as many workers as a node has cores, the kernel otherwise moves the workers
between cores whenever one of Ray's own processes wakes up, and each move costs the worker its warm caches; pinned,
Ray's processes share the cores but the workers stay put (measured +4% images/s with 2 workers on the 2-core dev
box, commit d7e85a4). Pinning is skipped, with a reason, when the node's workers would not each get their own
CPUs. Slots come from the local rank on the Ray node, so several raylets on one host (a test cluster) would
collide: leave it off there.

A serving replica is pinned whole (every thread it has, and those it starts later inherit it): a replica then owns
its CPUs as a GPU replica owns its device. Unpinned on one box, replicas share every core, so one whose readers are
all paused lends its CPU time to the others and the replicas are one pooled capacity, which no placement decision
can show a difference on (tokenflow bench routing --pin-cpus).
"""

from __future__ import annotations

import os


def cpus_for_worker(local_rank: int, local_world_size: int, threads: int, available: set[int]) -> set[int] | None:
    """The CPUs local worker `local_rank` gets: a contiguous slice of `threads` of the sorted available CPUs, or
    None when the node's workers cannot each have `threads` CPUs of their own."""
    if not 0 <= local_rank < local_world_size or threads < 1:
        raise ValueError(f"bad worker slot: local_rank={local_rank}, local_world_size={local_world_size}, "
                         f"threads={threads}")
    cpus = sorted(available)
    if local_world_size * threads > len(cpus):
        return None
    return set(cpus[local_rank * threads:(local_rank + 1) * threads])


def _slice(local_rank: int, local_world_size: int, threads: int) -> tuple[set[int] | None, str]:
    """This process's slice for the worker slot, or (None, why) when it cannot be pinned."""
    if not hasattr(os, "sched_setaffinity"):
        return None, "this OS has no sched_setaffinity"
    available = os.sched_getaffinity(0)
    cpus = cpus_for_worker(local_rank, local_world_size, threads, available)
    if cpus is None:
        return None, (f"{local_world_size} workers x {threads} threads do not fit on the {len(available)} CPUs "
                      f"this process may use")
    return cpus, ""


def pin_this_worker(local_rank: int, local_world_size: int, threads: int) -> tuple[set[int] | None, str]:
    """Pin the calling thread (the one running the training loop; torch's intra-op threads and any thread it starts
    later inherit it). Threads started before, such as gloo's and Ray's, stay free to run on any core. Returns
    (cpus or None, a one-line reason when not pinned)."""
    cpus, why = _slice(local_rank, local_world_size, threads)
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    return cpus, why


def pin_this_process(slot: int, threads: int) -> tuple[set[int] | None, str]:
    """Pin every thread of this process to the `slot`-th slice of `threads` available CPUs (slot r takes CPUs
    [r x threads, (r + 1) x threads) of the sorted set). Returns (cpus or None, a one-line reason when not pinned)."""
    cpus, why = _slice(slot, slot + 1, threads)  # the slots below this one need only exist, not be in use
    if cpus is None:
        return None, why
    for tid in os.listdir("/proc/self/task"):  # threads already started (Ray's, the event loop's, torch's)
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, PermissionError):  # a thread that ended meanwhile
            pass
    return cpus, ""

"""Which CPUs a pinned Train worker gets (scaling.pin_cpus), and pinning a real process."""

import multiprocessing as mp
import os

import pytest

from tokenflow_ray.affinity import cpus_for_worker, pin_this_worker


def test_each_local_worker_gets_its_own_slice_of_the_available_cpus():
    available = {3, 1, 7, 5}  # sorted: 1, 3, 5, 7
    assert [cpus_for_worker(r, 2, 2, available) for r in range(2)] == [{1, 3}, {5, 7}]
    assert [cpus_for_worker(r, 4, 1, available) for r in range(4)] == [{1}, {3}, {5}, {7}]


def test_no_pinning_when_the_workers_do_not_fit():
    assert cpus_for_worker(0, 3, 1, {0, 1}) is None
    assert cpus_for_worker(1, 2, 2, {0, 1, 2}) is None


@pytest.mark.parametrize("args", [(2, 2, 1), (-1, 2, 1), (0, 2, 0)])
def test_bad_slots_are_rejected(args):
    with pytest.raises(ValueError):
        cpus_for_worker(*args, {0, 1})


def _pin_and_report(out) -> None:
    out.put((pin_this_worker(0, 1, 1), os.sched_getaffinity(0)))


def test_pinning_restricts_the_calling_process():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_pin_and_report, args=(out,))
    p.start()
    try:
        (cpus, why), affinity = out.get(timeout=60)
        p.join(timeout=30)
    finally:  # whatever failed: a child left running would hang pytest's exit (multiprocessing joins it)
        if p.exitcode is None:
            p.kill()
        p.join()
    assert why == "" and cpus == {min(os.sched_getaffinity(0))} and affinity == cpus

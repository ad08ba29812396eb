"""CentralScheduler's report path when registration is asynchronous (the class alone, no Ray instance)."""

from __future__ import annotations

import asyncio
import time

import pytest

from tokenflow_ray.serve.central import CentralScheduler
from tokenflow_ray.serve.messages import Report

pytestmark = pytest.mark.timeout(30)


def test_a_report_that_beats_its_registration_waits_for_it():
    async def run() -> tuple[bool, float, list[Report]]:
        central = CentralScheduler(poll_s=0.05, register_grace_s=2.0)
        start = time.monotonic()
        report = asyncio.create_task(central.report(Report("s1", rate=3.0)))
        await asyncio.sleep(0.2)
        await central.register("s1", "r1", 1.0)
        known = await report
        return known, time.monotonic() - start, await central.wait_reports("r1")

    known, waited, delivered = asyncio.run(run())
    assert known and 0.2 <= waited < 1.0
    assert delivered == [Report("s1", rate=3.0)]


def test_unknown_ids_wait_the_grace_and_finished_ids_answer_at_once():
    async def run() -> dict[str, tuple[bool, float]]:
        central = CentralScheduler(register_grace_s=0.3, finished_memory=2)
        await central.register("done", "r1", None)
        await central.deregister("done")
        out = {}
        for sid in ("done", "never"):
            t = time.monotonic()
            out[sid] = (await central.report(Report(sid, paused=True)), time.monotonic() - t)
        await central.register("done", "r1", None)  # a registration that lost the race with the stream's end
        out["late"] = (await central.report(Report("done")), 0.0)
        for sid in ("a", "b"):  # older finished ids are forgotten past finished_memory
            await central.deregister(sid)
        out["forgotten"] = ("done" in central.finished, 0.0)
        return out

    out = asyncio.run(run())
    assert out["done"][0] is False and out["done"][1] < 0.1
    assert out["never"][0] is False and 0.3 <= out["never"][1] < 1.0
    assert out["late"][0] is False
    assert out["forgotten"][0] is False


def test_deregister_wakes_a_waiting_report():
    async def run() -> tuple[bool, float]:
        central = CentralScheduler(register_grace_s=5.0)
        t = time.monotonic()
        report = asyncio.create_task(central.report(Report("s")))
        await asyncio.sleep(0.1)
        await central.deregister("s")
        return await report, time.monotonic() - t

    known, waited = asyncio.run(run())
    assert known is False and waited < 1.0


def test_zero_grace_answers_unknown_at_once():
    async def run() -> float:
        central = CentralScheduler(register_grace_s=0.0)
        t = time.monotonic()
        assert await central.report(Report("x")) is False
        return time.monotonic() - t

    assert asyncio.run(run()) < 0.1


# ---- a dead replica's leftovers -------------------------------------------------------------------------------
async def _two_replicas(central: CentralScheduler) -> None:
    for sid, rid in (("a1", "r1"), ("a2", "r1"), ("b1", "r2")):
        await central.register(sid, rid, 1.0)
    for sid in ("a1", "b1"):
        assert await central.report(Report(sid, consumed_tokens=1))  # pending for each replica
    await central.wait_reports("r2", {"gauges": {}})
    await central.report(Report("b1", consumed_tokens=2))
    central.replica_stats["r1"] = (time.time(), {"gauges": {}})


def test_drop_replica_forgets_its_entries_reports_and_stats_only():
    async def run():
        central = CentralScheduler(poll_s=0.05)
        await _two_replicas(central)
        dropped = await central.drop_replica("r1")
        return dropped, central, await central.view(), await central.stats()

    dropped, central, view, stats = asyncio.run(run())
    assert dropped == 2 and set(view) == {"b1"} and view["b1"]["replica_id"] == "r2"
    assert "r1" not in central.pending and central.pending["r2"] == [Report("b1", consumed_tokens=2)]
    assert set(stats) == {"r2"}


def test_the_sweep_drops_a_silent_replica_and_keeps_a_polling_one():
    async def run():
        central = CentralScheduler(poll_s=0.05, stale_after_s=0.4)
        await _two_replicas(central)
        deadline = time.monotonic() + 1.2
        while time.monotonic() < deadline:  # r2 keeps polling, r1 (killed) is silent; nobody calls sweep()
            await central.wait_reports("r2")
        return central, await central.view()

    central, view = asyncio.run(run())
    assert set(view) == {"b1"} and "r1" not in central.pending and "r1" in central.dropped


def test_a_dropped_replica_that_polls_again_is_told_to_re_register():
    from tokenflow_ray.serve.central import ReplicaDropped

    async def run():
        central = CentralScheduler(poll_s=0.05, stale_after_s=0.1)
        await _two_replicas(central)
        await asyncio.sleep(0.2)
        await central.sweep()  # (the background sweep may have been first)
        swept = list(central.dropped)
        with pytest.raises(ReplicaDropped):  # only slow, not dead: its poll loop re-registers (replica.py)
            await central.wait_reports("r1")
        await central.register("a1", "r1", 1.0)
        known = await central.report(Report("a1", rate=2.0))
        return sorted(swept), known, await central.wait_reports("r1"), await central.view()

    swept, known, delivered, view = asyncio.run(run())
    assert swept == ["r1", "r2"] and known and delivered == [Report("a1", rate=2.0)]
    assert set(view) == {"a1"}

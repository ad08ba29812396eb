"""CentralScheduler: the report path when registration is batched, pushes batched per replica, dead replicas'
leftovers, and the table rebuilt after a restart (the class alone, no Ray instance)."""

from __future__ import annotations

import asyncio
import time

import pytest

from tokenflow_ray.cluster.messages import Report
from tokenflow_ray.cluster.stream_table import ReplicaChanges
from tokenflow_ray.serve.control.central import CentralScheduler, CentralSettings

pytestmark = pytest.mark.timeout(30)


def _central(**kw) -> CentralScheduler:
    kw.setdefault("deliver_timeout_s", 0.05)  # nobody polls in most of these tests: do not wait for delivery
    return CentralScheduler(CentralSettings("central", "ns", **kw))


async def _register(central: CentralScheduler, rid: str, *sids: str, rate: float | None = 1.0) -> None:
    full = not central.table.knows_replica(rid)
    assert not await central.update(rid, ReplicaChanges(full=full, added=tuple((s, rate) for s in sids)))


def test_a_report_that_beats_its_registration_waits_for_it():
    async def run() -> tuple[bool, float, list[Report]]:
        central = _central(poll_s=0.05, register_grace_s=2.0)
        start = time.monotonic()
        report = asyncio.create_task(central.report(Report("s1", rate=3.0)))
        await asyncio.sleep(0.2)
        await _register(central, "r1", "s1")
        known = await report
        return known, time.monotonic() - start, await central.wait_reports("r1")

    known, waited, delivered = asyncio.run(run())
    assert known and 0.2 <= waited < 1.0
    assert delivered == [Report("s1", rate=3.0)]


def test_unknown_ids_wait_the_grace_and_finished_ids_answer_at_once():
    async def run() -> dict[str, tuple[bool, float]]:
        central = _central(register_grace_s=0.3, finished_memory=2)
        await _register(central, "r1", "done")
        await central.update("r1", ReplicaChanges(removed=("done",)))
        out = {}
        for sid in ("done", "never"):
            t = time.monotonic()
            out[sid] = (await central.report(Report(sid, paused=True)), time.monotonic() - t)
        await _register(central, "r1", "done")  # a late batch naming a stream that already ended
        out["late"] = (await central.report(Report("done")), 0.0)
        for sid in ("a", "b"):  # older finished ids are forgotten past finished_memory
            await central.deregister(sid)
        out["forgotten"] = (central.table.is_finished("done"), 0.0)
        return out

    out = asyncio.run(run())
    assert out["done"][0] is False and out["done"][1] < 0.1
    assert out["never"][0] is False and 0.3 <= out["never"][1] < 1.0
    assert out["late"][0] is False
    assert out["forgotten"][0] is False


def test_an_ended_stream_wakes_a_waiting_report():
    async def run() -> tuple[bool, float]:
        central = _central(register_grace_s=5.0)
        t = time.monotonic()
        report = asyncio.create_task(central.report(Report("s")))
        await asyncio.sleep(0.1)
        await central.deregister("s")
        return await report, time.monotonic() - t

    known, waited = asyncio.run(run())
    assert known is False and waited < 1.0


def test_zero_grace_answers_unknown_at_once():
    async def run() -> float:
        central = _central(register_grace_s=0.0)
        t = time.monotonic()
        assert await central.report(Report("x")) is False
        return time.monotonic() - t

    assert asyncio.run(run()) < 0.1


def test_reports_are_pushed_to_their_owner_coalesced_in_one_batch():
    async def run():
        central = _central(poll_s=2.0, push_interval_s=0.1)
        await _register(central, "r1", "a", "b")
        await _register(central, "r2", "c")
        poll = asyncio.create_task(central.wait_reports("r1"))
        await asyncio.sleep(0.05)
        t = time.monotonic()
        sent = [asyncio.create_task(central.report(r)) for r in (
            Report("a", consumed_tokens=3), Report("b", paused=True), Report("a", rate=7.0),
            Report("a", consumed_tokens=5), Report("c", rate=1.0))]  # readers report concurrently
        delivered = await poll
        assert all(await asyncio.gather(*sent))
        return delivered, time.monotonic() - t, await central.wait_reports("r2"), await central.counters()

    delivered, took, other, counts = asyncio.run(run())
    # One push for r1 with one report per stream, the newest value of each field; c went to its own owner.
    assert sorted(delivered, key=lambda r: r.stream_id) == [Report("a", consumed_tokens=5, rate=7.0),
                                                              Report("b", paused=True)]
    assert took < 1.0 and other == [Report("c", rate=1.0)]
    assert counts["pushes"] == 2 and counts["reports_pushed"] == 3


def test_a_forwarded_report_is_answered_once_its_owner_took_it():
    async def run():
        central = _central(poll_s=5.0, push_interval_s=0.0, deliver_timeout_s=5.0)
        await _register(central, "r1", "a")
        report = asyncio.create_task(central.report(Report("a", rate=4.0)))
        await asyncio.sleep(0.3)
        pending = not report.done()  # queued, but its owner has not polled: the caller still waits
        t = time.monotonic()
        delivered = await central.wait_reports("r1")
        return pending, await report, time.monotonic() - t, delivered

    pending, known, took, delivered = asyncio.run(run())
    assert pending and known and took < 1.0 and delivered == [Report("a", rate=4.0)]


def test_a_restarted_actor_asks_for_snapshots_and_rebuilds_its_table():
    async def run():
        before = _central()
        await _register(before, "r1", "a", "b", rate=2.0)
        after = _central()  # a restart: a fresh instance, nothing carried over
        asked = await after.update("r1", ReplicaChanges(added=(("c", 1.0),)))  # an incremental batch: refused
        assert not await after.update("r1", ReplicaChanges(full=True, added=(("a", 2.0), ("b", 2.0), ("c", 1.0))))
        return asked, await after.view(), await after.report(Report("a", rate=9.0))

    asked, view, known = asyncio.run(run())
    assert asked is True and set(view) == {"a", "b", "c"} and known


def test_after_a_restart_a_report_waits_for_the_snapshot_past_the_registration_grace():
    """The replicas' snapshots can come seconds after a restart on a loaded box: a report for a live stream sent
    meanwhile is delivered, not answered 404 once the usual registration grace is over."""
    async def run(rebuilding: bool) -> tuple[bool, float]:
        central = _central(register_grace_s=0.1, rebuild_grace_s=2.0)
        if rebuilding:  # what __init__ sets in an actor Ray restarted (the class alone is never one)
            central.rebuilding_until = time.monotonic() + central.settings.rebuild_grace_s
        async def timed() -> tuple[bool, float]:
            start = time.monotonic()
            return await central.report(Report("a", rate=5.0)), time.monotonic() - start

        report = asyncio.create_task(timed())
        await asyncio.sleep(0.4)  # past register_grace_s
        await _register(central, "r1", "a")  # the replica's full snapshot
        return await report

    assert _central().rebuilding_until == 0.0  # a first start: no window
    known, waited = asyncio.run(run(rebuilding=True))
    assert known and 0.4 <= waited < 1.5
    known, waited = asyncio.run(run(rebuilding=False))
    assert not known and waited < 0.3


# ---- a dead replica's leftovers -------------------------------------------------------------------------------
async def _two_replicas(central: CentralScheduler) -> None:
    await _register(central, "r1", "a1", "a2")
    await _register(central, "r2", "b1")
    for sid in ("a1", "b1"):
        assert await central.report(Report(sid, consumed_tokens=1))  # pending for each replica
    await central.wait_reports("r2", {"gauges": {}})
    await central.report(Report("b1", consumed_tokens=2))
    central.replica_stats["r1"] = (time.time(), {"gauges": {}})


def test_drop_replica_forgets_its_entries_reports_and_stats_only():
    async def run():
        central = _central(poll_s=0.05)
        await _two_replicas(central)
        dropped = await central.drop_replica("r1")
        return dropped, central, await central.view(), await central.stats()

    dropped, central, view, stats = asyncio.run(run())
    assert dropped == 2 and set(view) == {"b1"} and view["b1"]["replica_id"] == "r2"
    assert not central.table.has_pushes("r1")
    assert central.table.take_pushes("r2") == [Report("b1", consumed_tokens=2)]
    assert set(stats) == {"r2"}


def test_the_sweep_drops_a_silent_replica_and_keeps_a_polling_one():
    async def run():
        central = _central(poll_s=0.05, stale_after_s=0.4)
        await _two_replicas(central)
        deadline = time.monotonic() + 1.2
        while time.monotonic() < deadline:  # r2 keeps polling, r1 (killed) is silent; nobody calls sweep()
            await central.wait_reports("r2")
        return central, await central.view()

    central, view = asyncio.run(run())
    assert set(view) == {"b1"} and not central.table.has_pushes("r1") and "r1" in central.table.dropped


def test_a_dropped_replica_that_was_only_slow_sends_a_snapshot_and_is_back():
    async def run():
        central = _central(poll_s=0.05, stale_after_s=0.1)
        await _two_replicas(central)
        await asyncio.sleep(0.2)
        await central.sweep()  # (the background sweep may have been first)
        swept = sorted(central.table.dropped)
        asked = await central.update("r1", ReplicaChanges(reports=(Report("a1", rate=2.0),)))
        await central.update("r1", ReplicaChanges(full=True, added=(("a1", 2.0),)))
        known = await central.report(Report("a1", rate=3.0))
        return swept, asked, known, await central.wait_reports("r1"), await central.view()

    swept, asked, known, delivered, view = asyncio.run(run())
    assert swept == ["r1", "r2"] and asked is True and known and delivered == [Report("a1", rate=3.0)]
    assert set(view) == {"a1"}


def test_the_migration_policy_sends_reliefs_and_moves_redirect_reports():
    from tokenflow_ray.cluster.messages import MoveOrder, RelieveOrder
    from tokenflow_ray.cluster.migration_policy import MigrationSettings

    def gauges(sum_rate, paused, device_free):
        return {"gauges": {"sum_rate": sum_rate, "waiting_rate": 0.0, "capacity_tok_s": 1000.0,
                           "num_paused": paused, "num_waiting": 0, "host_blocks_free": 100,
                           "device_blocks_free": device_free, "device_blocks_total": 100}}

    async def run():
        central = _central(poll_s=0.05, migration=MigrationSettings(interval_s=60.0))  # ticks by hand here
        await _register(central, "hot", "s1", "s2")
        await _register(central, "cool")
        await central.register_port("hot", "port-hot")
        await central.register_port("cool", "port-cool")
        await central.wait_reports("hot", gauges(800.0, 5, 0))  # device full, streams paused
        await central.wait_reports("cool", gauges(0.0, 0, 100))
        await central.set_migration(False)
        assert central.relieve_now() == []
        await central.set_migration(True)
        sent = central.relieve_now()
        assert central.relieve_now() == []  # the same source is left alone until its stats can show the effect
        orders = await central.wait_reports("hot")
        # A manual move of s1: the order reaches the owner, the owner's answer moves the table entry.
        move = asyncio.create_task(central.migrate("s1"))
        await asyncio.sleep(0.01)
        move_order = await central.wait_reports("hot")
        await central.report(Report("s1", rate=9.0))  # queued for the owner before the move completes
        await central.move_result("s1", {"moved": True, "source": "hot", "target": "cool"})
        return sent, orders, move_order, await move, await central.wait_reports("cool"), central.table.owner("s1")

    sent, orders, move_order, result, cool_reports, owner = asyncio.run(run())
    assert [(r.source, r.target, r.reason) for r in sent] == [("hot", "cool", "device_full")]
    assert orders == [RelieveOrder("cool", "port-cool", 400.0, 5, "device_full")]
    assert move_order == [MoveOrder("s1", "cool", "port-cool", "requested")]
    assert result["moved"] and owner == "cool"
    assert cool_reports == [Report("s1", rate=9.0)]  # the report queued for the old owner followed the stream


def test_a_replica_serve_is_stopping_is_drained_and_takes_no_streams():
    from tokenflow_ray.cluster.messages import MoveOrder

    async def run():
        central = _central(poll_s=0.05)
        await _register(central, "old", "a", rate=30.0)
        await _register(central, "old", "b", rate=10.0)
        await _register(central, "old", "c", rate=20.0)
        await _register(central, "x", "x1", rate=15.0)
        await _register(central, "y")
        for rid in ("old", "x", "y"):
            await central.register_port(rid, f"port-{rid}")
        plan = await central.drain("old")
        await asyncio.sleep(0.01)
        orders = await central.wait_reports("old")
        again = await central.drain("old")  # moves under way are not asked twice
        # A drained replica takes nothing: a manual move off another replica goes elsewhere.
        move = asyncio.create_task(central.migrate("x1"))
        await asyncio.sleep(0.01)
        x_orders = await central.wait_reports("x")
        await central.move_result("x1", {"moved": True, "source": "x", "target": "y"})
        await move
        for sid, target in plan:
            await central.move_result(sid, {"moved": True, "source": "old", "target": target, "reason": "drain"})
        await asyncio.sleep(0.01)
        owners = {sid: central.table.owner(sid) for sid in "abc"}
        draining = set(central.draining)
        await central.drop_replica("old")  # Serve stopped it
        return plan, orders, again, x_orders, owners, draining, central.draining

    plan, orders, again, x_orders, owners, draining, after = asyncio.run(run())
    # Fastest first, each to the least loaded so far: a (30) to y (0), c (20) to x (15 -> 35 after), b to y (30).
    assert plan == [("a", "y"), ("c", "x"), ("b", "y")]
    assert orders == [MoveOrder(s, t, f"port-{t}", "drain") for s, t in plan]
    assert again == []
    assert x_orders == [MoveOrder("x1", "y", "port-y", "requested")]  # not to "old"
    assert owners == {"a": "y", "b": "y", "c": "x"}
    assert draining == {"old"} and after == set()

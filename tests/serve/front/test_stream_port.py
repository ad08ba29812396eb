"""StreamPort, the class alone (no Ray): an offer answered by the target's import, deltas relayed in order,
a cancel reaching the target, an offer nobody picks up refused, an orphaned relay cancelled."""

from __future__ import annotations

import asyncio

import pytest

from tokenflow_ray.cluster.messages import Delta, Report
from tokenflow_ray.serve.http.stream_port import StreamPort

pytestmark = pytest.mark.timeout(30)


def test_offer_import_relay_report_and_cancel():
    async def run():
        port = StreamPort(offer_timeout_s=1.0)
        offer = asyncio.create_task(port.offer("s1", ["ref"], 0.0))
        inbox = await port.inbox(timeout_s=1.0)
        assert inbox == [("import", "s1", ["ref"], 0.0)]
        await asyncio.sleep(1.2)  # claimed: the offer waits past its timeout for the import's answer
        assert not offer.done()
        port.ack("s1", True)
        assert await offer
        assert port.put("s1", [Delta("a", 1, 3, 1)]) and port.put("s1", [Delta("b", 1, 3, 2)])
        taken = await port.take("s1")
        port.report(Report("s1", rate=2.0))
        reports = await port.inbox(timeout_s=0.1)
        port.put("s1", [Delta("c", 1, 3, 3, finished=True, finish_reason="length")])
        taken += await port.take("s1")
        with pytest.raises(KeyError):
            await port.take("s1")  # the relay ended with the finished delta
        offer2 = asyncio.create_task(port.offer("s2", ["ref2"], 0.0))
        await port.inbox(timeout_s=1.0)
        port.ack("s2", True)
        await offer2
        port.cancel("s2")
        return taken, reports, await port.inbox(timeout_s=0.1), port.put("s2", [Delta("x", 1, 3, 1)])

    taken, reports, inbox, accepted = asyncio.run(run())
    assert "".join(d.text for d in taken) == "abc"
    assert reports == [("report", Report("s1", rate=2.0))] and inbox == [("cancel", "s2")]
    assert not accepted  # the target learns to abort it


def test_an_unclaimed_offer_is_refused_and_an_orphan_is_cancelled():
    async def run():
        port = StreamPort(offer_timeout_s=0.1, orphan_after_s=0.2)
        refused = await port.offer("s1", ["ref"], 0.0)
        left = await port.inbox(timeout_s=0.05)
        offer = asyncio.create_task(port.offer("s2", ["ref"], 0.0))
        await port.inbox(timeout_s=0.05)
        port.ack("s2", True)
        await offer
        await asyncio.sleep(0.3)  # nobody takes s2's deltas: its source is gone
        first = await port.inbox(timeout_s=0.05)
        return refused, left, first, await port.inbox(timeout_s=0.05)

    refused, left, first, second = asyncio.run(run())
    assert refused is False and left == []  # withdrawn: the target never imports it
    assert ("cancel", "s2") in first + second

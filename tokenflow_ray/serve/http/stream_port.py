"""StreamPort: a replica's mailbox for stream migration, a small Ray actor the replica owns (it dies with it).

A Serve replica cannot be called by another replica directly (a handle picks the replica itself), so each replica
that may take migrated streams keeps a port, and the central actor hands its handle to the replicas that move
streams there:
- the source offers a stream (`offer`: its ExportedStream by object reference, so the KV goes from the source's
  object store to the target's without passing through here), answered once the target imported it or refused;
- the target takes offers, cancellations and consumption reports from its `inbox` long-poll, and puts the moved
  stream's deltas here (`put`);
- the source, which still holds the client's HTTP response, pulls them (`take`) and relays them, so the client
  sees one stream: the same id, no token lost or repeated. In the ingress placement the ingress holds the
  response, and it pulls from the port itself (`follow`): the source's part of the stream ends at the move, so a
  replica Serve is stopping is left with nothing to wait for.

If the target dies its port dies with it: the source's next `take` fails and the client gets an error event, as
for any replica lost mid-stream. If the source dies (the client's connection with it), the target's `put`s stop
being taken and the stream is cancelled after `orphan_after_s`.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from typing import Any

import ray

CANCELLED_MEMORY = 4096  # a put for a stream cancelled longer ago than this many cancellations finds no queue anyway


class StreamPort:
    def __init__(self, offer_timeout_s: float = 5.0, orphan_after_s: float = 30.0) -> None:
        self.offer_timeout_s = offer_timeout_s  # an offer the target has not picked up by then is refused
        self.orphan_after_s = orphan_after_s
        self._inbox: deque[tuple] = deque()
        self._inbox_event = asyncio.Event()
        self._acks: dict[str, asyncio.Future] = {}
        self._claimed: set[str] = set()
        self._out: dict[str, deque] = {}  # stream id -> deltas not yet taken by the source
        self._out_event: dict[str, asyncio.Event] = {}
        self._taken_at: dict[str, float] = {}
        self._cancelled: OrderedDict[str, None] = OrderedDict()  # recent cancellations (bounded)

    # ---- the source replica ---------------------------------------------------------------------------------------
    async def offer(self, stream_id: str, exported_ref: list, sent_at: float) -> bool:
        """Hand a stream to the target (`exported_ref`: [ObjectRef of its ExportedStream], in a list so Ray passes
        the reference, not the value). True once the target imported it; False if it refused or never looked."""
        future = asyncio.get_running_loop().create_future()
        self._acks[stream_id] = future
        self._out[stream_id] = deque()
        self._out_event[stream_id] = asyncio.Event()
        self._taken_at[stream_id] = time.monotonic()
        self._push(("import", stream_id, exported_ref, sent_at))
        try:
            # Once the target claimed it, the answer comes after its import (fast) or the port dies with it.
            return await asyncio.wait_for(asyncio.shield(future), self.offer_timeout_s)
        except asyncio.TimeoutError:
            if stream_id in self._claimed:
                return await future
            self._inbox = deque(m for m in self._inbox if not (m[0] == "import" and m[1] == stream_id))
            self._forget(stream_id)
            return False
        finally:
            self._acks.pop(stream_id, None)
            self._claimed.discard(stream_id)

    async def take(self, stream_id: str, timeout_s: float = 1.0) -> list:
        """The deltas the target produced since the last call (waits up to timeout_s for one)."""
        queue = self._out.get(stream_id)
        if queue is None:
            raise KeyError(f"stream {stream_id} is not relayed through this port")
        self._taken_at[stream_id] = time.monotonic()
        if not queue:
            event = self._out_event[stream_id]
            event.clear()
            try:
                await asyncio.wait_for(event.wait(), timeout_s)
            except asyncio.TimeoutError:
                return []
        items = list(queue)
        queue.clear()
        if items and getattr(items[-1], "finished", False):
            self._forget(stream_id)
        return items

    def cancel(self, stream_id: str) -> None:
        """The client left: the target aborts the stream."""
        self._cancel(stream_id)
        self._push(("cancel", stream_id))

    def report(self, report: Any) -> None:
        """A consumption report that reached the source: the target applies it."""
        self._push(("report", report))

    # ---- the target replica (the port's owner) ---------------------------------------------------------------------
    async def inbox(self, timeout_s: float = 1.0) -> list[tuple]:
        if not self._inbox:
            self._inbox_event.clear()
            try:
                await asyncio.wait_for(self._inbox_event.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
        items = list(self._inbox)
        self._inbox.clear()
        self._claimed.update(m[1] for m in items if m[0] == "import")
        self._inbox.extend(self._orphans())
        return items

    def ack(self, stream_id: str, imported: bool) -> None:
        future = self._acks.get(stream_id)
        if future is not None and not future.done():
            future.set_result(imported)
        if not imported:
            self._forget(stream_id)

    def put(self, stream_id: str, deltas: list) -> bool:
        """Deltas of a moved stream, in order; False: nobody reads it any more (abort it)."""
        queue = self._out.get(stream_id)
        if queue is None or stream_id in self._cancelled:
            return False
        queue.extend(deltas)
        self._out_event[stream_id].set()
        return True

    # ---- internals ---------------------------------------------------------------------------------------------------
    def _push(self, message: tuple) -> None:
        self._inbox.append(message)
        self._inbox_event.set()

    def _forget(self, stream_id: str) -> None:
        self._out.pop(stream_id, None)
        self._out_event.pop(stream_id, None)
        self._taken_at.pop(stream_id, None)

    def _cancel(self, stream_id: str) -> None:
        self._cancelled[stream_id] = None
        while len(self._cancelled) > CANCELLED_MEMORY:
            self._cancelled.popitem(last=False)
        self._forget(stream_id)

    def _orphans(self) -> list[tuple]:
        """Cancellations for streams whose source stopped taking their deltas (it died with their clients)."""
        now = time.monotonic()
        gone = [sid for sid, t in self._taken_at.items() if now - t > self.orphan_after_s and sid not in self._acks]
        for sid in gone:
            self._cancel(sid)
        return [("cancel", sid) for sid in gone]

    def stats(self) -> dict[str, int]:
        return {"relayed": len(self._out), "inbox": len(self._inbox), "cancelled": len(self._cancelled)}


async def follow(port: Any, stream_id: str) -> AsyncIterator[Any]:
    """The deltas of a moved stream, pulled from its new replica's port until the last. The port dies with that
    replica, so a lost replica fails the next pull (the caller answers with an error event). Left early (the
    client went away), it tells the port, and the new replica aborts the stream."""
    done = False
    try:
        while not done:
            for delta in await port.take.remote(stream_id):
                done = delta.finished  # before the yield: a reader may stop at the last delta and close us there
                yield delta
    finally:
        if not done:
            try:
                port.cancel.remote(stream_id)
            except Exception:  # noqa: BLE001 - that replica is gone too
                pass


# Owned by the replica that creates it (not detached): it goes when the replica goes.
StreamPortActor = ray.remote(num_cpus=0, max_restarts=0)(StreamPort)

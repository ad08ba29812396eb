"""The migration half of an LLMServer replica (server.py): moving its streams away and taking others in.

- Out: a MoveOrder (or a RelieveOrder, whose streams `migration_policy.pick_streams` chooses) from the central
  actor's long-poll pauses the stream, exports it between steps and offers it to the target's StreamPort; once the
  target imported it, the open response here relays the target's deltas (`_relay`), so the client sees one stream.
  A refused offer leaves the stream here, as it was.
- In: this replica's own StreamPort (serve/http/stream_port.py) brings offers, cancellations and reports for streams
  moved here; an adopted stream's deltas go back to its port, where the source pulls them.

A mixin: it uses the replica's engine (`aengine`, `engine`), its change log, its central actor handle, its move
metrics (`moves`, `metrics`) and `_deltas` (the token path's grouping), and keeps `_relayed`, `_adopted`, `_tasks`
and `port`, set in LLMServer.__init__.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import ray

from tokenflow_ray.cluster.messages import Delta, MoveOrder, RelieveOrder
from tokenflow_ray.cluster.migration_policy import pick_streams
from tokenflow_ray.serve.http.stream_port import follow

log = logging.getLogger(__name__)


class ReplicaMigration:
    # ---- out ------------------------------------------------------------------------------------------------------
    async def _migrate_out(self, order: MoveOrder) -> dict:
        """Pause the stream, export it between steps, offer it to the target's port; once taken, the client's
        response here relays the rest. A refused offer leaves the stream here, as it was."""
        sid, t0 = order.stream_id, time.monotonic()
        result = {"moved": False, "source": self.replica_id, "target": order.target_replica_id,
                  "reason": order.reason}
        try:
            exported = await self.aengine.export(sid)
            if exported is None:
                result["why"] = "finished before it could move"
            else:
                result.update(export_s=time.monotonic() - t0, kv_tokens=exported.num_kv_tokens)
                taken = False
                try:
                    taken = await order.target_port.offer.remote(sid, [ray.put(exported)], time.time())
                except Exception:  # noqa: BLE001 - the target is gone: the stream stays here
                    log.warning("offering %s to %s failed", sid, order.target_replica_id, exc_info=True)
                if taken:
                    self.changes.moved_out(sid)
                    await self.aengine.handed_off(sid, order.target_port)
                    result.update(moved=True, handoff_s=time.monotonic() - t0)
                else:
                    await self.aengine.take_back(exported)
                    result["why"] = "the target did not take it"
        except Exception as exc:  # noqa: BLE001 - reported to the central actor; the stream is unaffected
            log.warning("moving %s failed", sid, exc_info=True)
            result["why"] = f"{type(exc).__name__}: {exc}"
        self.moves.add(result)  # /metrics (through the stats) and Ray's metrics: reason, outcome, hand-off time
        self.metrics.observe_move(result)
        try:
            await self.central.move_result.remote(sid, result)
        except Exception:  # noqa: BLE001 - a restarting central actor rebuilds its table from the replicas
            log.warning("could not tell the central actor about moving %s", sid, exc_info=True)
        return result

    async def _relieve(self, order: RelieveOrder) -> list[dict]:
        """Move streams worth the order's rate to its target (migration_policy.pick_streams), all at once (each
        export waits only for its own copies)."""
        def pick() -> list[str]:  # engine thread
            return pick_streams(self.engine.scheduler, self.engine.clock.now(), order.rate, order.max_streams,
                                order.include_waiting)

        sids = await self.aengine.call(pick)
        return list(await asyncio.gather(*(self._migrate_out(
            MoveOrder(sid, order.target_replica_id, order.target_port, order.reason)) for sid in sids)))

    # ---- in -------------------------------------------------------------------------------------------------------
    async def _inbox_loop(self) -> None:
        """Streams offered to this replica, cancellations of moved streams and reports for them (StreamPort)."""
        while True:
            try:
                for message in await self.port.inbox.remote():
                    kind, sid = message[0], getattr(message[1], "stream_id", message[1])
                    if kind == "import":
                        self._adopted[sid] = self._spawn(self._serve_adopted(sid, message[2][0], message[3]))
                    elif kind == "cancel":
                        task = self._adopted.get(sid)
                        if task is not None:
                            task.cancel()
                    elif kind == "report":
                        try:
                            await self._route_report(message[1])
                        except ValueError as exc:  # ahead of what was generated: the reader model refuses it
                            log.debug("moved stream's report dropped: %s", exc)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the port is gone (this replica is going too) or a hiccup
                log.warning("stream port poll failed", exc_info=True)
                await asyncio.sleep(0.5)

    async def _serve_adopted(self, stream_id: str, exported_ref, sent_at: float) -> None:
        """Import a stream another replica moved here and feed its port with the deltas from now on."""
        port, acked = self.port, False
        try:
            exported = await exported_ref

            def on_added(sid: str) -> None:
                nonlocal acked
                acked = True
                port.ack.remote(sid, True)
                self.changes.add(sid, exported.rate)

            outputs = self.aengine.adopt(exported, max(0.0, time.time() - sent_at), on_added=on_added)
            async for delta in self._deltas(outputs, stream_id, exported.rate):
                if not await port.put.remote(stream_id, [delta]):
                    break  # nobody reads it any more: leaving the loop aborts it
        except asyncio.CancelledError:
            pass  # the source's client left
        except Exception:  # noqa: BLE001 - refused (no room, another model) or failed: the source keeps it
            log.warning("adopting %s failed", stream_id, exc_info=True)
        finally:
            self._adopted.pop(stream_id, None)
            if not acked:
                port.ack.remote(stream_id, False)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _start_port(self) -> None:
        """This replica's StreamPort, on its node, registered with the central actor (again after a restart)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from tokenflow_ray.serve.http.stream_port import StreamPortActor

        self.port = StreamPortActor.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(self.node_id, soft=True)).remote()
        await self.port.stats.remote()  # started
        await self.central.register_port.remote(self.replica_id, self.port)
        self._inbox = self._spawn(self._inbox_loop())

    # ---- the relay: a moved stream's response stays here ---------------------------------------------------------
    async def _relay(self, stream_id: str, port) -> AsyncIterator[Delta]:
        """The deltas of a stream that moved away, pulled from its new replica's port (stream_port.follow); its
        reports meanwhile go straight there (`_route_report`)."""
        self._relayed[stream_id] = port
        try:
            async for delta in follow(port, stream_id):
                yield delta
        finally:
            self._relayed.pop(stream_id, None)

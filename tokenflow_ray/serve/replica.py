"""LLMServer: the Serve deployment replica that owns one engine (model, device KV pool, host spill store).

Streams deltas to whoever answers HTTP (the replica itself in the direct placement, the ingress in the other:
ingress.py): the first token alone and at once, later tokens grouped by an interval that adapts to the reader's
buffer and the replica's load (grouping.py; ray-notes §6.3: a per-token item costs ~0.7 ms, batching the first
token costs TTFT).

Consumption reports for its own streams are applied here, on the engine thread, the moment they arrive; reports
that reached the cluster elsewhere come through the central actor's long-poll. Either way the central table hears
of every stream and report in batches (cluster/change_log.py), off the token path.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import ray
from ray import serve

from tokenflow_ray.affinity import pin_this_process
from tokenflow_ray.cluster.autoscaling import CRITICAL_BUFFER_S, ReplicaLoad, count_buffer_critical
from tokenflow_ray.cluster.change_log import ChangeLog, paced_buffers
from tokenflow_ray.cluster.replica_stats import replica_stats_from_engine
from tokenflow_ray.engine.async_engine import AsyncLLMEngine, StreamMoved
from tokenflow_ray.engine.config import EngineConfig
from tokenflow_ray.serve.central import CentralSettings, get_central, report_with_retry
from tokenflow_ray.serve.config import engine_config_for_rank
from tokenflow_ray.serve.grouping import DeltaGrouper, GroupingConfig
from tokenflow_ray.serve.ingress import queue_full
from tokenflow_ray.serve.messages import Delta, GenerateRequest, MoveOrder, RelieveOrder, Report, StopOrder
from tokenflow_ray.serve.metrics import MoveTotals, ReplicaMetrics, StreamTotals, engine_stats_dict
from tokenflow_ray.serve.replica_migration import ReplicaMigration
from tokenflow_ray.serve.stopping import ReplicaStopping

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaSettings:
    central: CentralSettings
    grouping: GroupingConfig = GroupingConfig()
    stats_interval_s: float = 0.5  # stats ride on the report long-poll at most this often
    # The ReplicaStats that record_routing_stats hands Serve are refreshed on the engine thread this often and
    # served from cache, so Serve's poll never waits behind a busy engine (keep it <= the routing stats period).
    routing_stats_interval_s: float = 0.5
    torch_threads: int = 0  # 0: leave torch's default (Ray sets OMP_NUM_THREADS from the replica's num_cpus)
    # >0: pin this replica's process to that many CPUs of its own, by its local rank on the node (affinity.py)
    pin_cpus: int = 0
    # A mixed fleet (ServeConfig.device_blocks_by_rank): the replica of Serve rank i holds a device pool of entry i
    # blocks; ranks past it keep the engine config's own. (): every replica alike.
    device_blocks_by_rank: tuple[int, ...] = ()
    sync_interval_s: float = 0.2  # the central table gets this replica's changes in one batch this often
    # Direct placement: streams beyond this many are refused 429 (admission.py); 0: no limit here (the ingress
    # placement bounds them with Serve's max_ongoing/max_queued_requests instead).
    stream_limit: int = 0
    retry_after_s: float = 1.0
    migration: bool = False  # keep a StreamPort: streams can be moved here (and this replica's moved away)
    critical_buffer_s: float = CRITICAL_BUFFER_S  # record_autoscaling_stats: readers under this are critical


def _counts(out) -> tuple[int, int]:
    """(prompt tokens, output tokens so far) of an engine output; (0, 0) before the first."""
    return (0, 0) if out is None else (out.num_prompt_tokens, out.num_output_tokens)


def _pin(local_rank: int, threads: int) -> None:
    """Replica `local_rank` on this node takes CPUs [rank x threads, (rank + 1) x threads); one that does not fit
    runs unpinned, said in the log (a replica is never refused for it)."""
    cpus, why = pin_this_process(local_rank, threads)
    if cpus is None:
        log.warning("replica at local rank %d not pinned: %s", local_rank, why)
    else:
        log.info("replica at local rank %d pinned to CPUs %s", local_rank, sorted(cpus))


class LLMServer(ReplicaMigration, ReplicaStopping):
    async def __init__(self, engine_config: EngineConfig, settings: ReplicaSettings, http=None, *extra) -> None:
        """`http` (IngressSettings) and `extra` (handles of deployments the routes call) in the direct placement."""
        from tokenflow_ray.runner.factory import build_engine  # torch loads here, not in the ingress

        self.settings = settings
        self.http = http
        if settings.pin_cpus > 0:  # first: every thread started from here on inherits it
            _pin(serve.get_replica_context().rank.local_rank, settings.pin_cpus)
        if settings.torch_threads > 0:
            import torch

            torch.set_num_threads(settings.torch_threads)
        engine_config = engine_config_for_rank(engine_config, settings.device_blocks_by_rank,
                                               serve.get_replica_context().rank.rank)
        self.engine = await asyncio.to_thread(build_engine, engine_config)
        self.aengine = AsyncLLMEngine(self.engine)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.node_id = ray.get_runtime_context().get_node_id()  # in the global view: where each replica runs
        self.central = get_central(settings.central)
        self.metrics = ReplicaMetrics(engine_config.model.model)
        self.totals = StreamTotals()
        self.moves = MoveTotals()  # streams moved away from here (replica_migration.py)
        self._seen_finished = 0
        self._last_snapshot = time.monotonic()
        self.changes = ChangeLog()  # live streams, and what the central table has yet to hear
        self._active = 0  # streams being generated (the unpaced grouping budget is shared among them)
        self._holding: dict[str, DeltaGrouper] = {}  # streams with tokens held for a group (_flush_loop)
        self._routing_stats: dict = {}  # the latest ReplicaStats.to_dict(); {} until the first refresh
        self._relayed: dict[str, object] = {}  # streams that moved away -> their new replica's port
        self._adopted: dict[str, asyncio.Task] = {}  # streams moved here -> the task feeding their source
        self._tasks: set[asyncio.Task] = set()
        self.port = None
        loop = asyncio.get_running_loop()
        if settings.migration:
            self._spawn(self._start_port())  # in the background: serving does not wait for it
        self._poll = loop.create_task(self._poll_loop())
        self._sync = loop.create_task(self._sync_loop())
        self._routing_refresh = loop.create_task(self._routing_stats_loop())
        self._flush = loop.create_task(self._flush_loop())

    # ---- token path -------------------------------------------------------------------------------------------
    async def generate(self, req: GenerateRequest, follow_moves: bool = False) -> AsyncIterator[Delta]:
        """The stream's deltas. If it moves to another replica: with `follow_moves` (the ingress placement) the last
        delta from here names the new replica's port and the caller pulls the rest there, so this replica's part
        ends at the move; else (this replica holds the client's response) the rest is relayed from there."""
        self._check_stopping()  # the app is stopping: ServerStopping, a 503 before any SSE header
        prompt = req.prompt if req.messages is None else self._chat_prompt(req.messages)

        def on_added(sid: str) -> None:
            # The central table learns of it in the next batch: the first token never waits for the actor. A
            # report that beats the batch there waits for it (CentralScheduler.register_grace_s).
            self.changes.add(sid, req.rate)

        outputs = self.aengine.generate(prompt, req.sampling, stream_id=req.stream_id, on_added=on_added,
                                        rate=req.rate)
        async for delta in self._deltas(outputs, req.stream_id,
                                        self.engine.config.default_rate if req.rate is None else req.rate,
                                        follow_moves):
            yield delta

    async def _deltas(self, outputs: AsyncIterator, stream_id: str, rate: float,
                      follow_moves: bool = False) -> AsyncIterator[Delta]:
        """The engine's outputs of one stream grouped into deltas (grouping.py); a stream holding tokens is in
        `_holding`, and `_flush_loop` ticks its iterator (a None) when they are due before a next output comes. If
        the stream moves to another replica, the rest comes from there through its port (migration), in order, as
        if it had stayed: relayed here, or pulled there by a caller that follows moves (`generate`)."""
        grouper = DeltaGrouper(self.settings.grouping, rate)
        text: list[str] = []
        last = None
        self._active += 1
        active = True
        try:
            try:
                async for out in outputs:
                    self._check_stopping()  # woken by a tick (stopping.py) if it has no output coming
                    now = time.monotonic()
                    if out is not None:
                        last = out
                        text.append(out.text)
                        grouper.hold(len(out.token_ids))
                    elif not grouper.held:
                        continue
                    if grouper.due(now, out is not None and out.finished, self._active):
                        self._holding.pop(stream_id, None)
                        yield Delta("".join(text), grouper.held, *_counts(last), last.finished, last.finish_reason)
                        grouper.sent_now(now)
                        text.clear()
                    else:
                        self._holding[stream_id] = grouper
            except StreamMoved as moved:
                self._active -= 1
                active = False
                if follow_moves:  # what this replica generated, and where the rest is
                    yield Delta("".join(text), grouper.held, *_counts(last), moved_to=moved.where)
                    return
                if grouper.held and last is not None:  # what this replica generated goes out before the relay
                    yield Delta("".join(text), grouper.held, last.num_prompt_tokens, last.num_output_tokens)
                async for delta in self._relay(stream_id, moved.where):
                    yield delta
        finally:
            self._holding.pop(stream_id, None)
            if active:
                self._active -= 1
            self.changes.remove(stream_id)

    async def _flush_loop(self) -> None:
        """Tokens held for a group go out when due even if their stream makes no new token by then (it was
        paused): every min_interval_s, a tick to each holding stream whose group is due. One timer for the
        replica, not one per stream and output."""
        period = max(self.settings.grouping.min_interval_s, 0.01)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for sid, grouper in list(self._holding.items()):
                if grouper.flush_due(now, self._active):
                    self.aengine.tick(sid)

    def _chat_prompt(self, messages: tuple[tuple[str, str], ...]) -> list[int]:
        tok = self.engine.tokenizer
        if getattr(tok, "chat_template", None) is None:
            raise ValueError("messages: this model has no chat template; use /v1/completions")
        ids = tok.apply_chat_template([{"role": r, "content": c} for r, c in messages], tokenize=True,
                                      add_generation_prompt=True)
        if hasattr(ids, "keys"):  # newer transformers return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    # ---- the HTTP routes' backend in the direct placement (ingress.py) -------------------------------------------
    def _new_stream_id(self, prefix: str) -> str:
        # The owner's id rides in the stream id, so the router sends the stream's reports here (slack_router.py).
        return f"{prefix}{uuid.uuid4().hex}-{self.replica_id}"

    async def _open_stream(self, req: GenerateRequest) -> AsyncIterator[Delta]:
        limit = self.settings.stream_limit
        if limit and self._active >= limit:
            raise queue_full(self.settings.retry_after_s)
        async for delta in self.generate(req):
            yield delta

    async def _route_report(self, report: Report) -> bool:
        if report.stream_id in self.changes.live:
            return await self.apply_report(report)
        port = self._relayed.get(report.stream_id)
        if port is not None:  # it moved from here: straight to its new replica
            port.report.remote(report)
            return True
        # Not ours (another router sent it here, or the stream moved): the central actor knows the owner.
        return await report_with_retry(self.central, report, self.http.report_retry_s)

    def _stream_lost(self, stream_id: str) -> None:  # a live replica loses no stream
        pass

    # ---- consumption reports and the central table -------------------------------------------------------------
    async def apply_report(self, report: Report) -> bool:
        """A report for one of this replica's streams, applied now; False if the stream is unknown or finished.
        A report the reader model refuses (e.g. more consumed than was generated) raises ValueError."""
        def apply() -> bool:  # engine thread
            try:
                self.engine.report_consumption(report.stream_id, report.consumed_tokens, report.rate, report.paused)
            except LookupError:
                return False
            return True

        known = await self.aengine.call(apply)
        if known:
            self.changes.reported(report)
        return known

    async def _poll_loop(self) -> None:
        last_stats = 0.0
        while True:
            try:
                stats = None
                if time.monotonic() - last_stats >= self.settings.stats_interval_s:
                    stats, last_stats = await self._stats_snapshot(), time.monotonic()
                reports = await self.central.wait_reports.remote(self.replica_id, stats)
                for order in [r for r in reports if isinstance(r, MoveOrder)]:
                    self._spawn(self._migrate_out(order))
                for order in [r for r in reports if isinstance(r, RelieveOrder)]:
                    self._spawn(self._relieve(order))
                for order in [r for r in reports if isinstance(r, StopOrder)]:
                    self._stop_serving(order)
                reports = [r for r in reports if isinstance(r, Report)]
                for r in [r for r in reports if r.stream_id in self._relayed]:
                    self._relayed[r.stream_id].report.remote(r)  # it moved on: forward it
                if reports:
                    await self.aengine.call(lambda rs=reports: self._apply(rs))
                    for r in reports:
                        self.changes.reported(r)
            except asyncio.CancelledError:
                raise
            except Exception:  # the central actor is restarting: the sync loop resends a full snapshot
                log.warning("report poll failed; retrying", exc_info=True)
                self.changes.need_full()
                await asyncio.sleep(0.5)

    def _apply(self, reports: list[Report]) -> None:  # engine thread
        for r in reports:
            try:
                self.engine.report_consumption(r.stream_id, r.consumed_tokens, r.rate, r.paused)
            except (LookupError, ValueError) as exc:  # finished meanwhile, or ahead of what was generated
                log.debug("report for %s dropped: %s", r.stream_id, exc)

    async def _sync_loop(self) -> None:
        """One batch of changes per interval to the central table; a full snapshot whenever it lost track.

        Batches are not awaited one by one: a slow actor must not delay the next batch (registrations would pile
        up behind it). Order does not matter to the table: a stream's end that overtakes its registration marks
        it finished, and the late registration is then ignored (StreamTable.apply_changes)."""
        interval = self.settings.sync_interval_s
        sending: set[asyncio.Task] = set()
        while True:
            await asyncio.sleep(interval)
            if not self.changes.pending:
                continue
            changes = self.changes.drain(await self.aengine.call(self._buffers))
            task = asyncio.get_running_loop().create_task(self._send(changes))
            sending.add(task)
            task.add_done_callback(sending.discard)

    async def _send(self, changes) -> None:
        try:
            if await self.central.update.remote(self.replica_id, changes):
                self.changes.need_full()  # the table was emptied (a restart): the next batch rebuilds it
                if self.port is not None:
                    await self.central.register_port.remote(self.replica_id, self.port)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.warning("central table update failed; the next one is a full snapshot", exc_info=True)
            self.changes.need_full()

    def _buffers(self) -> tuple[tuple[str, float], ...]:  # engine thread
        return paced_buffers(self.engine.scheduler.streams.values(), self.engine.clock.now())

    async def _routing_stats_loop(self) -> None:
        interval = self.settings.routing_stats_interval_s
        while True:
            try:
                # The report poll's snapshot refreshes the same cache; build one here only when it has not lately.
                if time.time() - self._routing_stats.get("computed_at", 0.0) >= interval:
                    self._cache_routing_stats(
                        await self.aengine.call(lambda: replica_stats_from_engine(self.engine)))
            except asyncio.CancelledError:
                raise
            except Exception:  # a dead engine fails its health check; the stats just stop changing
                log.exception("routing stats refresh failed")
            await asyncio.sleep(interval / 2)  # the cache is then never older than about the interval

    def _cache_routing_stats(self, rs) -> None:
        if rs.computed_at >= self._routing_stats.get("computed_at", 0.0):  # two refresh paths: keep the newer
            self._routing_stats = rs.to_dict()

    async def record_routing_stats(self) -> dict:
        """Serve's hook (RequestRouterConfig.request_routing_stats_period_s): the cached ReplicaStats."""
        return self._routing_stats

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics (serve/autoscaling_policy.py), recorded every metrics_interval_s when
        autoscaling is on: a fresh ReplicaStats plus the buffer-critical readers, one engine-thread call; the
        ReplicaStats also refreshes the routing cache."""
        def collect():
            rs = replica_stats_from_engine(self.engine)
            return rs, count_buffer_critical(self.engine, self.settings.critical_buffer_s)

        rs, critical = await self.aengine.call(collect)
        self._cache_routing_stats(rs)
        batch = self.engine.config.scheduler.max_num_seqs
        return ReplicaLoad.from_replica_stats(rs, batch, critical).to_metrics()

    async def _stats_snapshot(self) -> dict:
        def collect():  # engine thread: engine state is only touched there
            es = self.engine.stats()
            rs = replica_stats_from_engine(self.engine, es)
            # One snapshot for both consumers: /metrics gets the routing fields under the same names, and the
            # router's cache gets the same numbers.
            stats = engine_stats_dict(es)
            stats.pop("min_buffer_s", None)  # ReplicaStats' definition (absent when no paced stream runs)
            stats.update(rs.gauges())
            done = stats.get("streams_finished", 0)
            new = min(done - self._seen_finished, len(self.engine.finished_records))
            self._seen_finished = done
            records = list(self.engine.finished_records)[len(self.engine.finished_records) - new:] if new else []
            now = self.engine.clock.now()
            buffers = [s.reader.buffer_at(now) for s in self.engine.scheduler.streams.values()]
            stats["buffer_tokens_mean"] = sum(buffers) / len(buffers) if buffers else 0.0
            return stats, records, rs

        stats, records, rs = await self.aengine.call(collect)
        self._cache_routing_stats(rs)
        before, now = self.totals.effective_tokens, time.monotonic()
        self.totals.add(records)
        # Effective throughput over the window since the last snapshot (streams count when they finish).
        stats["effective_tput"] = (self.totals.effective_tokens - before) / max(1e-3, now - self._last_snapshot)
        self._last_snapshot = now
        self.metrics.observe(records, stats)
        return {"gauges": stats, "totals": self.totals.to_dict(), "moves": self.moves.to_dict(),
                "node_id": self.node_id}

    def _kv_usage(self) -> dict[str, int]:  # engine thread
        usage = {"device_blocks_total": self.engine.pool.num_blocks, "device_blocks_free": self.engine.pool.num_free}
        host = getattr(getattr(self.engine.scheduler, "kv", None), "host", None) or getattr(
            self.engine, "host_pool", None)
        if host is not None:
            usage.update(host_blocks_total=host.num_blocks, host_blocks_free=host.num_free)
        return usage

    # ---- introspection (handle calls from tests, bench and the ingress) ----------------------------------------
    async def kv_usage(self) -> dict[str, int]:
        return await self.aengine.call(self._kv_usage)

    async def stream_state(self, stream_id: str) -> dict | None:
        def read():
            s = self.engine.get_stream(stream_id)
            if s is None:
                return None
            now = self.engine.clock.now()
            return {"status": s.status.name, "rate": s.reader.rate, "paused": s.reader.paused,
                    "buffer": s.reader.buffer_at(now), "consumed": s.reader.consumed_at(now),
                    "generated": s.reader.generated, "num_device_blocks": len(s.block_ids)}

        return await self.aengine.call(read)

    async def runtime_info(self) -> dict:
        import os

        import torch

        return {"pid": os.getpid(), "torch_threads": torch.get_num_threads(),
                "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "cpus": sorted(os.sched_getaffinity(0)),
                "local_rank": serve.get_replica_context().rank.local_rank}

    async def check_integrity(self) -> bool:
        await self.aengine.call(self.engine.check_integrity)
        return True

    async def stats(self) -> dict:
        return await self._stats_snapshot()

    async def check_health(self) -> None:
        # A dead or wedged engine thread never answers; Serve then restarts the replica.
        await asyncio.wait_for(self.aengine.call(lambda: None), timeout=20.0)

    def __del__(self) -> None:
        for name in ("_poll", "_sync", "_routing_refresh", "_flush"):
            task = getattr(self, name, None)
            if task is not None:
                task.cancel()
        for task in list(getattr(self, "_tasks", ())):
            task.cancel()
        if hasattr(self, "aengine"):
            self.aengine.shutdown(timeout=1.0)

"""What an LLMServer replica (server.py) tells Serve and the central actor about itself: the ReplicaStats the
request router reads (`record_routing_stats`, served from a cache refreshed on the engine thread), the autoscaling
metrics (`record_autoscaling_stats`), and the stats snapshot that rides on the report long-poll (`_stats_snapshot`:
/metrics, routing and autoscaling read it at the central actor).

A mixin: it uses the replica's engine (`engine`, `aengine`), settings, metrics and totals, set in
LLMServer.__init__.
"""

from __future__ import annotations

import asyncio
import logging
import time

from tokenflow_ray.cluster.autoscaling import ReplicaLoad, count_buffer_critical
from tokenflow_ray.cluster.replica_stats import replica_stats_from_engine
from tokenflow_ray.serve.replica.metrics import engine_stats_dict

log = logging.getLogger(__name__)


class StatsPublisher:
    """What Serve and the central actor read about this replica, each from one engine-thread call."""

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
        """Serve's custom autoscaling metrics (serve/control/autoscaling_policy.py), recorded every metrics_interval_s when
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

"""LLMServer: the Serve deployment replica that owns one engine (model, device KV pool, host spill store).

Its parts, each a mixin of its own file, all over the engine this class builds and its background loops:
- token_path.py: a stream's deltas for whoever answers HTTP (the replica itself in the direct placement, the ingress
  in the other: serve/http/ingress.py), and the direct placement's route backend;
- central_link.py: consumption reports applied on the engine thread, the central actor's long-poll (reports and
  orders), and the central table kept current in batches;
- stats.py: what Serve's router and autoscaler and the central actor read about this replica;
- migration.py: streams moved away and taken in; stopping.py: the app's clean stop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import ray
from ray import serve

from tokenflow_ray.affinity import pin_this_process
from tokenflow_ray.cluster.autoscaling import CRITICAL_BUFFER_S
from tokenflow_ray.cluster.change_log import ChangeLog
from tokenflow_ray.engine.async_engine import AsyncLLMEngine
from tokenflow_ray.engine.config import EngineConfig
from tokenflow_ray.serve.control.central import CentralSettings, get_central
from tokenflow_ray.serve.replica.admission import KVClaims
from tokenflow_ray.serve.replica.central_link import CentralLink
from tokenflow_ray.serve.replica.fleet import engine_config_for_rank
from tokenflow_ray.serve.replica.grouping import DeltaGrouper, GroupingConfig
from tokenflow_ray.serve.replica.metrics import MoveTotals, ReplicaMetrics, StreamTotals
from tokenflow_ray.serve.replica.migration import ReplicaMigration
from tokenflow_ray.serve.replica.stats import StatsPublisher
from tokenflow_ray.serve.replica.stopping import ReplicaStopping
from tokenflow_ray.serve.replica.token_path import TokenPath

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
    # Direct placement: a stream whose claim (prompt + max_tokens, in KV blocks) would take the admitted streams'
    # claims past this many blocks is refused 429 (admission.py); 0: no limit here (the ingress placement bounds
    # them with Serve's max_ongoing/max_queued_requests instead).
    kv_budget_blocks: int = 0
    retry_after_s: float = 1.0
    migration: bool = False  # keep a StreamPort: streams can be moved here (and this replica's moved away)
    critical_buffer_s: float = CRITICAL_BUFFER_S  # record_autoscaling_stats: readers under this are critical


def _pin(local_rank: int, threads: int) -> None:
    """Replica `local_rank` on this node takes CPUs [rank x threads, (rank + 1) x threads); one that does not fit
    runs unpinned, said in the log (a replica is never refused for it)."""
    cpus, why = pin_this_process(local_rank, threads)
    if cpus is None:
        log.warning("replica at local rank %d not pinned: %s", local_rank, why)
    else:
        log.info("replica at local rank %d pinned to CPUs %s", local_rank, sorted(cpus))


class LLMServer(TokenPath, CentralLink, StatsPublisher, ReplicaMigration, ReplicaStopping):
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
        self.moves = MoveTotals()  # streams moved away from here (migration.py)
        self._seen_finished = 0
        self._last_snapshot = time.monotonic()
        self.changes = ChangeLog()  # live streams, and what the central table has yet to hear
        self._active = 0  # streams being generated (the unpaced grouping budget is shared among them)
        self._claims = KVClaims(settings.kv_budget_blocks)  # the direct placement's admission (admission.py)
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

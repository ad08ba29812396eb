"""The discrete-event loop: N engines (the real LLMEngine, Scheduler, policy, BlockPool and KV manager) on one
virtual clock, each with a SimRunner, behind the cluster's routing decision (the contract: docs/design.md §9.1).

Events, in a heap ordered by (time, kind, sequence) so equal times settle deterministically (arrivals before
steps, replicas in id order):
- an arrival: the router picks a replica (cluster/routing.py's `rank_replicas` over each replica's
  `ReplicaStats`, built by cluster/replica_stats.py from the engine as the Serve replica builds it, refreshed every
  `stats_period_s` as Serve polls; cluster/inflight.py's ledger books the streams routed since), and the stream
  is added to that engine at the arrival time;
- a replica's wake-up: if a step is in flight and ends now, `finish_step` applies its result at this time; then
  `begin_step` plans the next one at this time, the SimRunner prices it, and the replica wakes again when it ends;
  with nothing to run, the replica sleeps until `LLMEngine.next_event_time()`.
- with `migration` (N > 1), the central actor's tick every `interval_s` (migration.py: the cluster's StreamTable
  fed from each replica's ChangeLog, `plan_relief` over the replicas' gauges) and a moved stream's landing on
  its target after its KV crossed the network; each replica acts on both between two of its steps (after
  `finish_step`, before `begin_step`), where it exports and imports streams.
With one replica the whole workload is handed to the engine up front (future arrivals, held by the engine) and
nothing is routed. Conservation checks (conservation.py) run after every step when `checks` is on; with
migration the table is checked against every engine's live streams on every tick.

Not simulated yet: Serve's bounded queue / 429.
"""

from __future__ import annotations

import heapq
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tokenflow_ray.cluster.inflight import InflightLedger
from tokenflow_ray.cluster.migration_policy import MigrationSettings
from tokenflow_ray.cluster.replica_stats import ReplicaStats, replica_stats_from_engine
from tokenflow_ray.cluster.routing import NewStream, SlackRouterConfig, rank_replicas
from tokenflow_ray.engine.clock import VirtualClock
from tokenflow_ray.engine.config import EngineConfig
from tokenflow_ray.engine.llm_engine import BegunStep, LLMEngine
from tokenflow_ray.engine.plan import StepPlan, StepResult
from tokenflow_ray.engine.runner_api import ModelInfo
from tokenflow_ray.engine.sampling import SamplingParams
from tokenflow_ray.metrics.stream_metrics import StreamRecord
from tokenflow_ray.sim.cold_start import ColdStart
from tokenflow_ray.sim.conservation import ConservationChecker
from tokenflow_ray.sim.cost import HostLink, StepCost
from tokenflow_ray.sim.migration import ClusterMigration, InTransit, MigrationLink
from tokenflow_ray.sim.sim_runner import SimRunner
from tokenflow_ray.workloads.generators import RequestSpec
from tokenflow_ray.workloads.prompts import sim_prompt

ROUTERS = ("slack", "pow2", "round_robin", "pinned")  # pinned: every arrival to r000 (a hot-replica scenario)
_ARRIVAL, _REPLICA, _LAND, _TICK = 0, 1, 2, 3


@dataclass(frozen=True)
class ReplicaSetup:
    """What each simulated replica is: the engine config it runs and the cost model of its device."""

    engine: EngineConfig
    info: ModelInfo
    cost: StepCost
    link: HostLink
    cpu_overhead_s: float = 0.0  # scheduler time per step on the host
    cold: ColdStart | None = None  # what is not yet warm costs (measured engine profiles; cold_start.py)
    # The host plans step N+1 while the device runs N (EngineConfig.overlap_scheduling, on with CUDA): the overhead
    # then costs only what exceeds the device step. False: serial with it.
    overlap_scheduling: bool = False


@dataclass
class SimReplica:
    replica_id: str
    engine: LLMEngine
    runner: SimRunner
    checker: ConservationChecker | None
    in_flight: tuple[BegunStep, StepResult, float] | None = None  # the step running, its result, when it ends
    wake_version: int = 0
    stats: ReplicaStats | None = None
    stats_at: float = float("-inf")


@dataclass
class SimOutcome:
    records: list[StreamRecord]
    replicas: list[SimReplica]
    wall_s: float
    steps: int
    sim_end_s: float
    per_replica_streams: dict[str, int] = field(default_factory=dict)
    migration: ClusterMigration | None = None


class Simulation:
    def __init__(self, setup: ReplicaSetup, num_replicas: int = 1, router: str = "slack",
                 router_config: SlackRouterConfig | None = None, stats_period_s: float = 0.5, checks: bool = True,
                 integrity: bool = False, seed: int = 0, migration: MigrationSettings | None = None,
                 migration_link: MigrationLink | None = None, migration_on: bool = True,
                 replica_setups: Sequence[ReplicaSetup] | None = None) -> None:
        """`migration`: run the central actor's table and relief policy (N > 1); `migration_on=False` feeds and
        checks the table but moves nothing (the comparison run). `replica_setups`: one setup per replica (a
        heterogeneous cluster: devices of several kinds serving one model); None: `num_replicas` of `setup`."""
        if num_replicas < 1:
            raise ValueError(f"replicas: must be >= 1, got {num_replicas!r}")
        if replica_setups is not None:
            if len(replica_setups) != num_replicas:
                raise ValueError(f"replica_setups: one per replica ({num_replicas}), got {len(replica_setups)}")
            if any(s.info != setup.info for s in replica_setups):
                raise ValueError("replica_setups: every replica must serve the same model (ModelInfo)")
        if router not in ROUTERS:
            raise ValueError(f"router: expected one of {', '.join(ROUTERS)}, got {router!r}")
        if not stats_period_s > 0:
            raise ValueError("stats_period_s: must be > 0")
        self.setup = setup
        self.clock = VirtualClock()
        self.router = router
        self.router_config = router_config or SlackRouterConfig()
        self.stats_period_s = stats_period_s
        self.ledger = InflightLedger(self.router_config.inflight_ttl_s)
        self._rng = random.Random(f"{seed}:router")
        self._rr = 0
        self.replicas: list[SimReplica] = []
        for i, rs in enumerate(replica_setups or [setup] * num_replicas):
            cache = rs.engine.cache
            runner = SimRunner(rs.info, rs.cost, cache.block_size, rs.link,
                               overlap_copies=cache.overlap_copies, cpu_overhead_s=rs.cpu_overhead_s, cold=rs.cold,
                               clock=self.clock, overlap_scheduling=rs.overlap_scheduling)
            engine = LLMEngine(rs.engine, runner, tokenizer=None, clock=self.clock)
            checker = ConservationChecker(engine, integrity=integrity) if checks else None
            self.replicas.append(SimReplica(f"r{i:03d}", engine, runner, checker))
        self._heap: list[tuple[float, int, int, int, int]] = []  # (time, kind, seq, index, version)
        self._seq = 0
        self.migration = None
        if migration is not None:
            if num_replicas < 2:
                raise ValueError("migration: needs replicas >= 2")
            self.migration = ClusterMigration([r.engine for r in self.replicas], [r.replica_id for r in self.replicas],
                                              setup.info.kv_bytes_per_token, migration, migration_link, migration_on)
        self._landing: dict[int, str] = {}  # event seq -> stream id whose KV lands then
        self._heap_seq = 0  # the sequence number of the event being handled
        self._total = 0
        self._done = 0

    def warm_up(self, prompt_len: int = 8, output_len: int = 4) -> float:
        """One unpaced request through the single replica before the workload, as every driver of the real engine
        runs one (real_runs.STANDARD_WARMUP): the engine's learnt costs and the runner's cold state then start where
        a real run's did. Returns the clock after it; offset the workload's arrivals by it."""
        if len(self.replicas) != 1:
            raise ValueError("warm_up: one replica only")
        self.run([RequestSpec(-1, self.clock.now(), prompt_len, output_len, 0.0)])
        now = self.clock.now()
        cold = self.replicas[0].runner.cold
        if cold is not None:
            cold.start_run(now)
        return now

    # ---- the loop ---------------------------------------------------------------------------------------------
    def run(self, requests: Sequence[RequestSpec], progress: Callable[[int, int], None] | None = None,
            max_sim_s: float = 1e6) -> SimOutcome:
        """Simulate `requests` (arrival_s from time 0) to completion; returns every stream's record."""
        wall = time.perf_counter()
        for r in self.replicas:
            r.engine.finished_records = type(r.engine.finished_records)(maxlen=len(requests) + 1)
        if len(self.replicas) == 1:
            for req in requests:
                self._add(self.replicas[0], req)
            self._wake(0, self.clock.now())  # a second run on the same simulation starts where the first ended
        else:
            for req in requests:
                self._push(req.arrival_s, _ARRIVAL, req.index)
        self._total, self._done = len(requests), 0
        if self.migration is not None and requests:
            self._push(self.migration.settings.interval_s, _TICK, 0)
        by_index = {req.index: req for req in requests}
        steps = 0
        done = 0
        while self._heap:
            t, kind, self._heap_seq, index, version = heapq.heappop(self._heap)
            if t > max_sim_s:
                raise RuntimeError(f"simulation passed {max_sim_s} s of virtual time with streams unfinished")
            self.clock.advance_to(t)
            if kind == _ARRIVAL:
                self._route(by_index[index], t)
                continue
            if kind == _TICK:
                self._tick(t)
                continue
            if kind == _LAND:
                self._land(index, t)
                continue
            replica = self.replicas[index]
            if version != replica.wake_version:
                continue  # superseded by a later wake-up
            finished = self._advance(index, t)
            steps += finished >= 0
            done += max(finished, 0)
            if progress is not None and finished > 0:
                progress(done, len(requests))
        records = [rec for r in self.replicas for rec in r.engine.finished_records]
        unfinished = sum(r.engine.has_unfinished() for r in self.replicas)
        if unfinished or (self.migration is not None and self.migration.busy):
            raise RuntimeError(f"simulation ended with {unfinished} replicas holding unfinished streams"
                               + (" and moves under way" if self.migration is not None and self.migration.busy else ""))
        return SimOutcome(records, self.replicas, time.perf_counter() - wall, steps, self.clock.now(),
                          {r.replica_id: r.engine.stats().streams_finished for r in self.replicas}, self.migration)

    def _advance(self, index: int, now: float) -> int:
        """Finish the replica's step if it ends now, then start the next one. Returns the streams finished (-1:
        no step ended here)."""
        replica = self.replicas[index]
        engine = replica.engine
        finished = -1
        if replica.in_flight is not None:
            begun, result, end = replica.in_flight
            if end > now:  # woken early (an arrival): the step is still running
                self._wake(index, end)
                return -1
            replica.in_flight = None
            outputs = engine.finish_step(begun, result, now)
            finished = self._after(replica, begun.plan, result, outputs, now)
        if self.migration is not None:  # between two steps: streams leave and enter here
            self.migration.at_boundary(index, now, self._send)
        begun = engine.begin_step()
        if begun.plan is None:
            finished = max(finished, 0) + self._after(replica, None, None, begun.outputs, now)
            nxt = engine.next_event_time()
            if nxt is not None:
                self._wake(index, max(nxt, now))
            return finished
        result = replica.runner.execute(begun.plan)
        end = now + result.step_s
        replica.in_flight = (begun, result, end)
        self._wake(index, end)
        return finished

    def _after(self, replica: SimReplica, plan: StepPlan | None, result: StepResult | None, outputs: list,
               now: float) -> int:
        if replica.checker is not None:
            replica.checker.after_step(plan, result, outputs)
        finished = 0
        for o in outputs:
            if o.finished:
                finished += 1
                if len(self.replicas) > 1:
                    self.ledger.complete(o.stream_id, now)
                if self.migration is not None:
                    self.migration.finished(self.replicas.index(replica), o.stream_id)
        self._done += finished
        return finished

    # ---- migration ----------------------------------------------------------------------------------------------
    def _tick(self, now: float) -> None:
        """The central actor's tick; a source with reliefs and no step running acts on them now. Ticks go on
        while any stream is unfinished."""
        mig = self.migration
        mig.tick(now)
        for i, orders in enumerate(mig.orders):
            if orders and self.replicas[i].in_flight is None:
                self._wake(i, now)
        if self._done < self._total:
            self._push(now + mig.settings.interval_s, _TICK, 0)

    def _send(self, move: InTransit, arrival: float) -> None:
        self._push(arrival, _LAND, move.target)
        self._landing[self._seq] = move.exported.stream_id

    def _land(self, index: int, now: float) -> None:
        seq = self._heap_seq
        target = self.migration.land(self._landing.pop(seq))
        if self.replicas[target].in_flight is None:  # idle: it takes the stream now (else after its step)
            self._wake(target, now)

    # ---- arrivals and routing ---------------------------------------------------------------------------------
    def _add(self, replica: SimReplica, req: RequestSpec) -> None:
        # Token values do not matter to the SimRunner; which prefixes repeat matters to prefix caching.
        prompt = sim_prompt(req.index, req.prompt_len, req.hash_ids, replica.engine.runner.info.vocab_size)
        replica.engine.add_request(prompt, SamplingParams(max_tokens=req.output_len, ignore_eos=True),
                                   stream_id=f"req-{req.index}", arrival_time=req.arrival_s, rate=req.rate)

    def _route(self, req: RequestSpec, now: float) -> None:
        index = self.choose_replica(req, now)
        replica = self.replicas[index]
        self._add(replica, req)
        if self.router == "slack":
            rid = replica.replica_id
            self.ledger.book(f"req-{req.index}", rid, now, req.rate, req.prompt_len)
            self.ledger.accepted(f"req-{req.index}", rid)
        if self.migration is not None:
            self.migration.added(index, f"req-{req.index}", req.rate)
        if replica.in_flight is None:
            self._wake(index, now)

    def choose_replica(self, req: RequestSpec, now: float) -> int:
        n = len(self.replicas)
        if self.router == "pinned":
            return 0
        if self.router == "round_robin":
            self._rr = (self._rr + 1) % n
            return self._rr
        if self.router == "pow2":  # Serve's default: two random candidates, the shorter queue
            a, b = self._rng.sample(range(n), 2)
            la, lb = (self.replicas[i].engine.scheduler.num_unfinished for i in (a, b))
            return a if (la, a) <= (lb, b) else b
        self.ledger.expire(now)
        stats: dict[str, ReplicaStats] = {}
        for r in self.replicas:
            if now - r.stats_at >= self.stats_period_s:
                r.stats = replica_stats_from_engine(r.engine, wall_time=now)
                r.stats_at = now
                self.ledger.observe(r.replica_id, r.stats.admitted_total, r.stats.finished_total)
            stats[r.replica_id] = r.stats
        loads = {rid: self.ledger.load(rid) for rid in stats}
        best = rank_replicas(stats, loads, NewStream(req.rate, req.prompt_len), self.router_config)[0]
        return int(best[1:])

    # ---- heap -------------------------------------------------------------------------------------------------
    def _push(self, t: float, kind: int, index: int, version: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, kind, self._seq, index, version))

    def _wake(self, index: int, t: float) -> None:
        replica = self.replicas[index]
        replica.wake_version += 1
        self._push(t, _REPLICA, index, replica.wake_version)

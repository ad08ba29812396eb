"""`tokenflow bench migration`: what moving a stream costs, and what moving paused streams off a hot replica buys.

Two parts, both on real engines (the embedded model, real KV copies), in one process:

1. Downtime against recompute. A stream runs alone on engine A until it has `context` tokens; it is then moved to
   engine B: paused, exported between steps, its ExportedStream pickled and unpickled (what Ray's object store
   does to it), imported, and resumed by loading its KV. Downtime: from the move's start to the stream's next
   token on B. Then it is moved back without its KV, which is what a move costs a system that does not carry KV:
   recompute, from the move's start to the next token. Each context length, `moves` times.
2. A hot replica, on Ray Serve over HTTP. A seeded burst lands on replica A alone, replica B idle beside it (a
   router that prefers the replica next to the proxy does this; here A and B are two one-replica, one-CPU apps
   sharing one central actor, and the burst goes to A's route). Without migration B stays idle; with it, the
   central actor's migration policy (cluster/migration_policy.py) moves paused, then waiting, streams from A to
   B through the replicas' stream ports while the clients keep reading from A. Client-side figures (the load
   generator's readers), medians over `rounds` alternating rounds, every round kept.

Part 1 leaves out the Ray hops of a served hand-off (the offer to the target's port, the relay's first pull);
part 2's `handoff_ms_p50` is the whole served move, from the order to the hand-off.
"""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
import random
import statistics
import time
from dataclasses import asdict, dataclass

from tokenflow_ray.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tokenflow_ray.engine.sampling import SamplingParams


@dataclass(frozen=True)
class MigrationBenchConfig:
    model: str = "embedded"
    contexts: tuple[int, ...] = (64, 256, 512, 1024)  # tokens of a stream when it moves (downtime part)
    moves: int = 5  # per context length
    # The hot-replica burst: Σ declared rate (48 x 30 = 1440 tok/s) above what one one-CPU replica delivers over
    # HTTP on this box (~1000 tok/s) and below what two do (~1900): A alone must pause readers, A with B need not.
    streams: int = 48
    prompt_len: int = 48
    max_tokens: int = 192  # each stream draws from [0.5x, 1.5x]
    rate: float = 30.0  # each reader draws 0.5x or 1.5x
    burst_s: float = 2.0
    rounds: int = 3
    seed: int = 0
    policy: str = "tokenflow"
    block_size: int = 16
    num_device_blocks: int = 160  # per replica: the burst does not fit one replica's device pool
    num_host_blocks: int = 2048
    max_num_seqs: int = 32
    timeout_s: float = 300.0
    move_waiting: bool = False  # the policy also moves streams waiting to start (MigrationSettings.move_waiting)

    def __post_init__(self) -> None:
        if not self.contexts or min(self.contexts) < 2 or self.moves < 1:
            raise ValueError("contexts must be >= 2 tokens and moves >= 1")
        if min(self.streams, self.prompt_len, self.max_tokens, self.rounds) < 1 or self.rate <= 0:
            raise ValueError("streams, prompt_len, max_tokens, rounds and rate must be positive")

    def engine_config(self, max_model_len: int | None = None) -> EngineConfig:
        return EngineConfig(
            model=ModelConfig(model=self.model, dtype="float32", device="cpu", num_threads=1,
                              max_model_len=max_model_len),
            cache=CacheConfig(block_size=self.block_size, num_device_blocks=self.num_device_blocks,
                              num_host_blocks=self.num_host_blocks),
            scheduler=SchedulerConfig(max_num_seqs=self.max_num_seqs, policy=self.policy),
            record_history=max(1000, self.streams))


# ---- 1. downtime against recompute -------------------------------------------------------------------------------
def _steps_until_token(engine, sid: str, limit: int = 10_000) -> None:
    for _ in range(limit):
        if any(o.stream_id == sid and o.token_ids for o in engine.step()):
            return
    raise RuntimeError(f"{sid}: no token within {limit} steps")


def _export(engine, sid: str):
    engine.begin_export(sid)
    while (exported := engine.try_export(sid)) is None:
        engine.step()
    return pickle.loads(pickle.dumps(exported))  # what the object store does to it


def measure_downtime(cfg: MigrationBenchConfig, progress=print) -> dict:
    from tokenflow_ray.runner.factory import build_engine

    longest = max(cfg.contexts) + 64
    blocks = -(-longest // cfg.block_size) + 8
    ecfg = dataclasses.replace(cfg.engine_config(), cache=CacheConfig(
        block_size=cfg.block_size, num_device_blocks=max(blocks, cfg.num_device_blocks), num_host_blocks=2 * blocks))
    a, b = build_engine(ecfg), build_engine(ecfg)
    rng = random.Random(cfg.seed)
    rows = []
    for context in cfg.contexts:
        for i in range(cfg.moves):
            prompt = [rng.randrange(1, 250) for _ in range(context - 1)]
            sid = a.add_request(prompt, SamplingParams(max_tokens=64, ignore_eos=True), stream_id=f"m{context}-{i}")
            _steps_until_token(a, sid)  # prefill: `context` tokens in the stream
            for _ in range(3):
                _steps_until_token(a, sid)  # a few decodes: the write-through has mirrored the full blocks
            t0 = time.perf_counter()
            exported = _export(a, sid)
            b.import_stream(exported, b.clock.now() - exported.exported_at)
            _steps_until_token(b, sid)
            downtime = time.perf_counter() - t0
            t0 = time.perf_counter()
            back = dataclasses.replace(_export(b, sid), kv=None, num_kv_tokens=0)  # a move without the KV
            a.import_stream(back, a.clock.now() - back.exported_at)
            _steps_until_token(a, sid)
            recompute = time.perf_counter() - t0
            a.abort(sid)
            a.step()
            rows.append({"context": context, "tokens": exported.num_tokens, "kv_tokens": exported.num_kv_tokens,
                         "downtime_ms": downtime * 1e3, "recompute_ms": recompute * 1e3})
        last = [r for r in rows if r["context"] == context]
        progress(f"context {context}: downtime p50 {_p([r['downtime_ms'] for r in last], 50):.1f} ms, "
                 f"recompute p50 {_p([r['recompute_ms'] for r in last], 50):.1f} ms")
    for engine in (a, b):
        if engine.runner.transfer is not None:
            engine.runner.transfer.close()
    by_context = {}
    for context in cfg.contexts:
        sel = [r for r in rows if r["context"] == context]
        by_context[str(context)] = {"downtime_ms_p50": _p([r["downtime_ms"] for r in sel], 50),
                                    "recompute_ms_p50": _p([r["recompute_ms"] for r in sel], 50)}
    return {"downtime_ms": _pcts([r["downtime_ms"] for r in rows]),
            "recompute_ms": _pcts([r["recompute_ms"] for r in rows]),
            "by_context": by_context, "moves": rows}


# ---- 2. a hot replica, with and without migration, on Ray Serve -----------------------------------------------------
HOT, COOL = "mig_hot", "mig_cool"


def serve_configs(cfg: MigrationBenchConfig) -> tuple:
    """Two one-replica apps sharing one central actor: the burst goes to the hot app's route; the cool app's
    replica is the other replica of the cluster the migration policy sees."""
    from tokenflow_ray.serve.config import ServeConfig, serve_engine

    engine = serve_engine(policy=cfg.policy, block_size=cfg.block_size, num_device_blocks=cfg.num_device_blocks,
                          num_host_blocks=cfg.num_host_blocks, max_num_seqs=cfg.max_num_seqs)
    common = dict(replicas=1, migration=True, central_app=HOT, num_cpus=1.0, engine=engine,
                  expected_stream_tokens=cfg.prompt_len + cfg.max_tokens, migrate_waiting=cfg.move_waiting,
                  images=False)
    return (ServeConfig(app_name=HOT, route_prefix=f"/{HOT}", **common),
            ServeConfig(app_name=COOL, route_prefix=f"/{COOL}", **common))


def burst(cfg: MigrationBenchConfig):
    from tokenflow_ray.client import StreamSpec

    rng = random.Random(cfg.seed)
    out = []
    for i in range(cfg.streams):
        words = " ".join(rng.choice(("sea", "wind", "ships", "stars", "rain", "maps")) for _ in range(8))
        out.append(StreamSpec(f"Reader {i:03d}: tell me about {words}.",
                              max_tokens=max(1, round(cfg.max_tokens * rng.uniform(0.5, 1.5))),
                              rate=cfg.rate * rng.choice((0.5, 1.5)), start_s=rng.uniform(0, cfg.burst_s)))
    return out


def _admitted(central) -> dict[str, int]:
    import ray

    return {rid: int(s["gauges"]["admitted_total"]) for rid, s in ray.get(central.stats.remote()).items()}


def _hot_round(url: str, cfg: MigrationBenchConfig, central, migrate: bool) -> dict:
    import ray

    from tokenflow_ray.client import StreamSpec, run_load

    ray.get(central.set_migration.remote(False))
    asyncio.run(run_load(url, [StreamSpec("warm up", max_tokens=2)], timeout_s=60))
    time.sleep(1.0)  # the replicas' stats (0.5 s) show the idle state before the burst
    before, t0 = _admitted(central), time.time()
    ray.get(central.set_migration.remote(migrate))
    res = asyncio.run(run_load(url, burst(cfg), timeout_s=cfg.timeout_s, report_interval_s=1.0))
    ray.get(central.set_migration.remote(False))
    time.sleep(1.0)
    after = _admitted(central)
    moves = [m for m in ray.get(central.recent_moves.remote()) if m["t"] >= t0]
    done = [m for m in moves if m.get("moved")]
    s = res.summary()
    return {"effective_tput": s.effective_tput, "ttft_p50_s": s.ttft_p50_s, "ttft_p99_s": s.ttft_p99_s,
            "raw_tput": s.raw_tput, "stall_s": s.stall_s, "migrations": len(done),
            "migrations_failed": len(moves) - len(done),
            "handoff_ms_p50": _p([m["handoff_s"] * 1e3 for m in done], 50) if done else None,
            "streams_admitted_per_replica": sorted((after.get(r, 0) - before.get(r, 0) for r in after), reverse=True),
            "complete": res.num_complete, "rejected": res.num_rejected}


def hot_replica(cfg: MigrationBenchConfig, progress=print) -> dict:
    import ray

    from tokenflow_ray.serve.app import deploy, undeploy
    from tokenflow_ray.serve.local import local_serve

    hot_cfg, cool_cfg = serve_configs(cfg)
    rounds: dict[str, list[dict]] = {"with": [], "without": []}
    with local_serve(num_cpus=2) as base_url:
        try:
            deploy(hot_cfg)
            deploy(cool_cfg)
            central = ray.get_actor(hot_cfg.central_actor_name, namespace=hot_cfg.central_namespace)
            deadline = time.monotonic() + 120
            while ray.get(central.port_count.remote()) < 2:
                if time.monotonic() > deadline:
                    raise RuntimeError("the replicas' stream ports did not register within 120 s")
                time.sleep(0.5)
            url = f"{base_url}/{HOT}"
            for r in range(cfg.rounds):
                for arm in (("with", "without") if r % 2 == 0 else ("without", "with")):
                    out = _hot_round(url, cfg, central, arm == "with")
                    rounds[arm].append(out)
                    progress(f"round {r} {arm:>7} migration: effective {out['effective_tput']:.0f} tok/s, raw "
                             f"{out['raw_tput']:.0f}, TTFT p99 {out['ttft_p99_s']:.2f} s, stall {out['stall_s']:.1f} s, "
                             f"{out['migrations']} moves, admitted per replica {out['streams_admitted_per_replica']}")
        finally:
            undeploy(cool_cfg)
            undeploy(hot_cfg)
    keys = ("effective_tput", "ttft_p99_s", "ttft_p50_s", "raw_tput", "stall_s", "migrations")
    return {arm: {**{k: statistics.median(x[k] for x in runs) for k in keys},
                  "complete": min(x["complete"] for x in runs), "rounds": runs}
            for arm, runs in rounds.items()}


def run_migration_bench(cfg: MigrationBenchConfig, progress=print) -> dict:
    down = measure_downtime(cfg, progress)
    hot = hot_replica(cfg, progress)
    return {"config": asdict(cfg), **down, "hot_replica": hot,
            "migration_vs_recompute_p50": down["recompute_ms"]["p50"] / max(1e-9, down["downtime_ms"]["p50"]),
            "effective_with_over_without": hot["with"]["effective_tput"] / max(1e-9, hot["without"]["effective_tput"])}


def _p(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def _pcts(values: list[float]) -> dict[str, float]:
    return {"p50": _p(values, 50), "p99": _p(values, 99)}


def print_table(report: dict) -> None:
    print(f"downtime p50 {report['downtime_ms']['p50']:.1f} ms / p99 {report['downtime_ms']['p99']:.1f} ms; "
          f"recompute p50 {report['recompute_ms']['p50']:.1f} ms / p99 {report['recompute_ms']['p99']:.1f} ms")
    for arm in ("with", "without"):
        h = report["hot_replica"][arm]
        print(f"{arm:>7} migration: effective {h['effective_tput']:.0f} tok/s, raw {h['raw_tput']:.0f}, "
              f"TTFT p99 {h['ttft_p99_s']:.2f} s, stall {h['stall_s']:.1f} s, {h['migrations']:.0f} moves")

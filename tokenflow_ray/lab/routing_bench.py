"""`tokenflow bench routing`: one seeded burst over 2 replicas, routed by the buffer-slack router and by Serve's
default (power of two choices on queue length), compared.

Fair by construction (cluster-notes §5.2): both apps are deployed side by side on the same Ray instance with the
same replica count, engine config and stats period, so only the routing decision differs; the same burst (fixed
seed, fixed schedule) runs against each in turn, the order alternating round by round, and each figure is the
median over rounds, with every round kept in the JSON. With two routers the JSON's `paired` compares them round by
round (lab/paired.py): each round's ratio, their geometric mean and its bootstrap interval, so a verdict says
whether the difference clears the box's noise, which moved one router's 5-round median ahead in one run and behind
in the next at the same settings. The burst mixes reading rates (7x apart), prompt and output lengths:
a router that balances stream counts (Serve's) and one that balances demand against capacity and buffer slack
(ours) only differ when streams differ.

Prompt lengths are a seeded mix: most are short chat turns (~40-120 bytes, the embedded tokenizer is byte-level so
about as many tokens), and `long_prompt_share` of the streams carry a long context (a document or a conversation's
history) of `long_prompt_tokens` x [0.5, 1.5] tokens. Real traffic mixes both (RAG and multi-turn chat put
hundreds to thousands of tokens before a short question), and that is where placement decides first-token
latency: a long prefill holds its replica's steps for a few tenths of a second here, and every stream placed
behind it waits. The default is 0, the homogeneous burst of short prompts, where the routers differ by demand
alone: the workload of docs/results/cluster.md's figures. `--long-prompt-share 0.15` (at the default 1024: 512-1536 tokens, with
1.5x of the outputs within the embedded model's 2048 positions) is a modest share of long contexts.

`device_blocks` (`--device-blocks 384,128`) makes the fleet a mixed one, as GPUs of different memory are: replica
i's device KV pool is entry i (ServeConfig.device_blocks_by_rank), all else alike. Serve's default router counts
requests, so it gives the small pool as many streams as the large one; the slack router reads each replica's free
blocks and prices a replica that must pause someone to fit a prompt (`cluster/routing.py`). Equal replicas sharing
one box tie (docs/results/cluster.md); the mixed fleet is the case a router that reads replica state is for.

Streams per replica are counted by the replicas themselves (ReplicaStats.admitted_total before and after, through
the central actor's stats); the central actor's view of which replica each live stream is on, sampled while the
burst runs, gives the per-replica time series of the PNG.
"""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass

from tokenflow_ray.client import LoadResult, StreamSpec, run_load
from tokenflow_ray.lab.paired import compare_rounds
from tokenflow_ray.serve.config import ROUTERS, ServeConfig, serve_engine


@dataclass(frozen=True)
class RoutingBenchConfig:
    # Near what two replicas deliver over HTTP on this 2-core box (Σ rates 1920 tok/s): within capacity every
    # router can start every stream at once and they tie (48 streams at Σ 576 tok/s: 309 vs 320 effective tok/s,
    # P99 TTFT 0.18 s both), so the default sits where placement decides who starves.
    streams: int = 64
    max_tokens: int = 192  # mean output length; each stream draws from [0.5x, 1.5x]
    rate: float = 30.0  # mean reading rate; each reader draws 0.25x or 1.75x (seeded): uneven demand per stream
    burst_s: float = 2.0  # arrivals spread uniformly (seeded) over this long
    replicas: int = 2
    rounds: int = 3
    # Unmeasured bursts per router before the measured rounds (kept in the JSON apart). Without them the router
    # that goes first also takes the session's cold start: its first round read a TTFT p50 of 1.5 s against
    # 0.5-1.0 s in its later ones, and one such round moves a 5-round median.
    warm_rounds: int = 1
    seed: int = 0
    routers: tuple[str, ...] = ("slack", "default")
    cpus_per_replica: float = 1.0
    # Each replica pinned to cpus_per_replica CPUs of its own (ServeConfig.pin_cpus): replicas as separate devices.
    # Unpinned, the replicas share every core, and one whose readers are paused lends its CPU to the other.
    pin_cpus: bool = False
    policy: str = "tokenflow"
    num_device_blocks: int = 256  # per replica: contention, so placement matters
    num_host_blocks: int = 1024
    # A mixed fleet: replica i's device pool (ServeConfig.device_blocks_by_rank), as GPUs of different memory hold
    # (an A6000's 48 GB beside an H200's 141 GB: about 1 to 3). (): num_device_blocks each.
    device_blocks: tuple[int, ...] = ()
    timeout_s: float = 240.0  # per run
    sample_s: float = 0.2
    long_prompt_share: float = 0.0  # streams with a long context (round(share x streams) of them, seeded)
    long_prompt_tokens: int = 1024  # their mean prompt length; each draws [0.5x, 1.5x]

    def __post_init__(self) -> None:
        if min(self.streams, self.max_tokens, self.replicas, self.rounds) <= 0 or self.rate <= 0:
            raise ValueError("streams, max_tokens, replicas, rounds and rate must be positive")
        if isinstance(self.warm_rounds, bool) or not isinstance(self.warm_rounds, int) or self.warm_rounds < 0:
            raise ValueError(f"warm_rounds: must be an int >= 0, got {self.warm_rounds!r}")
        if not 0.0 <= self.long_prompt_share <= 1.0:
            raise ValueError(f"long_prompt_share: must be in [0, 1], got {self.long_prompt_share!r}")
        if isinstance(self.long_prompt_tokens, bool) or not isinstance(self.long_prompt_tokens, int) \
                or self.long_prompt_tokens < 1:
            raise ValueError(f"long_prompt_tokens: must be an int >= 1, got {self.long_prompt_tokens!r}")
        longest = self.long_prompt_tokens * 3 // 2 + round(self.max_tokens * 1.5) + 1  # + BOS
        if self.long_prompt_share > 0 and longest > MODEL_POSITIONS:
            raise ValueError(f"long_prompt_tokens: 1.5x of it plus 1.5x of max_tokens ({longest} tokens) exceeds the "
                             f"embedded model's {MODEL_POSITIONS} positions")
        if self.device_blocks and len(self.device_blocks) != self.replicas:
            raise ValueError(f"device_blocks: one pool per replica ({self.replicas}), got {list(self.device_blocks)}")
        if not self.routers or any(r not in ROUTERS for r in self.routers):
            raise ValueError(f"routers: any of {', '.join(ROUTERS)}, got {self.routers!r}")
        for r in self.routers:
            self.serve_config(r)  # validates the rest before anything starts

    def serve_config(self, router: str) -> ServeConfig:
        name = f"route_{router}"
        pin = math.ceil(self.cpus_per_replica) if self.pin_cpus else 0
        return ServeConfig(app_name=name, route_prefix=f"/{name}", replicas=self.replicas, router=router,
                           num_cpus=self.cpus_per_replica, pin_cpus=pin,
                           device_blocks_by_rank=self.device_blocks,
                           expected_stream_tokens=64 + self.max_tokens,
                           images=False, engine=serve_engine(policy=self.policy, num_device_blocks=self.num_device_blocks,
                                                             num_host_blocks=self.num_host_blocks))

    def long_prompts(self) -> dict[int, int]:
        """Stream index -> its long prompt's length in tokens (bytes), for the seeded long-context share. Its own
        generator, so the rest of the burst (rates, outputs, arrivals) is the same at every share."""
        rng = random.Random(f"long-prompts-{self.seed}")
        chosen = sorted(rng.sample(range(self.streams), round(self.long_prompt_share * self.streams)))
        return {i: max(1, round(self.long_prompt_tokens * rng.uniform(0.5, 1.5))) for i in chosen}

    def specs(self) -> list[StreamSpec]:
        rng = random.Random(self.seed)
        long = self.long_prompts()
        out = []
        for i in range(self.streams):
            words = rng.randint(2, 16)  # prompts of ~40-120 bytes
            topic = " ".join(rng.choice(WORDS) for _ in range(words))
            question = f"Reader {i:03d}: tell me about {topic}."
            prompt = _document(long[i] - len(question) - 1, i) + " " + question if i in long else question
            out.append(StreamSpec(prompt, max_tokens=max(1, round(self.max_tokens * rng.uniform(0.5, 1.5))),
                                  rate=self.rate * rng.choice((0.25, 1.75)), start_s=rng.uniform(0, self.burst_s)))
        return out

    def prompt_mix(self) -> dict:
        """What the JSON reports of the prompt lengths (bytes = tokens for the byte-level tokenizer)."""
        lengths = sorted(len(s.prompt.encode()) for s in self.specs())
        return {"long_streams": len(self.long_prompts()), "prompt_tokens_p50": statistics.median(lengths),
                "prompt_tokens_max": lengths[-1], "prompt_tokens_total": sum(lengths)}


WORDS = ("sea", "wind", "ships", "stars", "rain", "maps")
MODEL_POSITIONS = 2048  # the embedded model's max_position_embeddings (models/embedded.py)


def _document(num_bytes: int, seed: int) -> str:
    """A seeded context of exactly `num_bytes` ASCII bytes (at least one): the long part of a long prompt."""
    rng = random.Random(f"document-{seed}")
    parts: list[str] = []
    size = 0
    while size <= num_bytes:  # the join is size - 1 bytes long
        parts.append(rng.choice(WORDS))
        size += len(parts[-1]) + 1
    return " ".join(parts)[:max(1, num_bytes)]


@dataclass
class RoutingRun:
    router: str
    round: int
    load: LoadResult
    per_replica: dict[str, int]  # replica label -> streams it served
    timeline: list[tuple[float, dict[str, int]]]  # (seconds since start, replica label -> live streams)

    def summary(self) -> dict:
        s = self.load.summary()
        counts = sorted(self.per_replica.values(), reverse=True)
        return {"effective_tput": s.effective_tput, "ttft_p50_s": s.ttft_p50_s, "ttft_p99_s": s.ttft_p99_s,
                "raw_tput": s.raw_tput, "stall_s": s.stall_s, "per_replica_streams": counts,
                "complete": self.load.num_complete, "rejected": self.load.num_rejected, "round": self.round}


def _admitted(central) -> dict[str, int]:
    """Streams each replica's engine ever admitted (ReplicaStats.admitted_total, as its last stats report)."""
    import ray

    return {rid: int(s["gauges"]["admitted_total"]) for rid, s in ray.get(central.stats.remote()).items()}


def _settled(central, expected: int, before: dict[str, int], timeout_s: float = 30.0) -> dict[str, int]:
    """Per-replica admissions since `before`, once the replicas' stats account for all `expected` of them."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = _admitted(central)
        delta = {rid: n - before.get(rid, 0) for rid, n in now.items()}
        if sum(delta.values()) >= expected or time.monotonic() > deadline:
            return delta
        time.sleep(0.2)


async def _sampled_load(base_url: str, specs: list[StreamSpec], central, cfg: RoutingBenchConfig):
    import ray

    timeline: list[tuple[float, dict[str, int]]] = []
    start = time.monotonic()
    load = asyncio.create_task(run_load(base_url, specs, timeout_s=cfg.timeout_s, report_interval_s=1.0))
    while True:  # live streams per replica, as the central actor's view places them (one sample after the end)
        done = load.done()
        view = await asyncio.to_thread(lambda: ray.get(central.view.remote()))
        counts: dict[str, int] = {}
        for v in view.values():
            counts[v["replica_id"]] = counts.get(v["replica_id"], 0) + 1
        timeline.append((time.monotonic() - start, counts))
        if done:
            return await load, timeline
        await asyncio.sleep(cfg.sample_s)


def _run_once(base_url: str, cfg: RoutingBenchConfig, router: str, rnd: int, central) -> RoutingRun:
    warm = cfg.replicas
    start = _admitted(central)
    asyncio.run(run_load(base_url, [StreamSpec("warm up", max_tokens=2)] * warm, timeout_s=60))
    _settled(central, warm, start)  # the warm-up is in the stats: what follows is the burst's alone
    before = _admitted(central)
    res, timeline = asyncio.run(_sampled_load(base_url, cfg.specs(), central, cfg))
    # Counted by the replicas themselves: a short stream can start and end between two samples of the view.
    delta = _settled(central, res.num_admitted, before)
    replicas = sorted(set(delta) | {rid for _, c in timeline for rid in c})
    label = {rid: f"replica {i}" for i, rid in enumerate(replicas)}
    per_replica = {label[rid]: delta.get(rid, 0) for rid in replicas}
    series = [(t, {label[rid]: c.get(rid, 0) for rid in replicas}) for t, c in timeline]
    return RoutingRun(router, rnd, res, per_replica, series)


def _median_summary(runs: list[RoutingRun]) -> dict:
    rounds = [r.summary() for r in runs]
    out = {k: statistics.median(s[k] for s in rounds)
           for k in ("effective_tput", "ttft_p50_s", "ttft_p99_s", "raw_tput", "stall_s")}
    width = max(len(s["per_replica_streams"]) for s in rounds)
    padded = [s["per_replica_streams"] + [0] * (width - len(s["per_replica_streams"])) for s in rounds]
    out["per_replica_streams"] = [statistics.median(col) for col in zip(*padded)]  # most loaded first
    out["complete"] = min(s["complete"] for s in rounds)
    out["rounds"] = rounds
    return out


def run_routing_bench(cfg: RoutingBenchConfig) -> tuple[dict, dict[str, list[RoutingRun]]]:
    from tokenflow_ray.serve.app import deploy, undeploy
    from tokenflow_ray.serve.control.central import CentralSettings, central_name, get_central
    from tokenflow_ray.serve.local import local_serve

    started = time.monotonic()
    configs = {r: cfg.serve_config(r) for r in cfg.routers}
    cpus = max(2, int(round(cfg.replicas * cfg.cpus_per_replica * len(cfg.routers) + 0.5)))
    runs: dict[str, list[RoutingRun]] = {r: [] for r in cfg.routers}
    warm: dict[str, list[RoutingRun]] = {r: [] for r in cfg.routers}
    order: list[str] = []
    with local_serve(num_cpus=cpus) as base_url:
        try:
            for sc in configs.values():
                deploy(sc)
            centrals = {r: get_central(CentralSettings(central_name(sc.app_name), sc.central_namespace))
                        for r, sc in configs.items()}
            for rnd in range(-cfg.warm_rounds, cfg.rounds):  # negative rounds: the unmeasured warm-up bursts
                for router in (cfg.routers if rnd % 2 == 0 else tuple(reversed(cfg.routers))):
                    url = f"{base_url}{configs[router].route_prefix}"
                    measured = rnd >= 0
                    (runs if measured else warm)[router].append(_run_once(url, cfg, router, rnd, centrals[router]))
                    if measured:
                        order.append(router)
        finally:
            for sc in configs.values():
                undeploy(sc)
    report = {"workload": {**asdict(cfg), "routers": list(cfg.routers), **cfg.prompt_mix()}, "order": order,
              "routers": {r: {**_median_summary(rs), "warm_rounds": [w.summary() for w in warm[r]]}
                          for r, rs in runs.items()},
              "wall_s": time.monotonic() - started}
    if len(cfg.routers) == 2 and cfg.rounds >= 2:
        report["paired"] = paired_report(report, *cfg.routers)
    return report, runs


# The figures a router is judged on, and which way is better.
PAIRED_METRICS = {"effective_tput": True, "ttft_p99_s": False, "ttft_p50_s": False, "raw_tput": True}
PAIRED_LEVEL = 0.95


def paired_report(report: dict, a: str, b: str) -> dict:
    """Router a against router b round by round (the rounds ran side by side): lab/paired.py."""
    ratios = compare_rounds(report["routers"][a]["rounds"], report["routers"][b]["rounds"], PAIRED_METRICS,
                            PAIRED_LEVEL)
    return {"a": a, "b": b, "level": PAIRED_LEVEL, "metrics": {k: v.to_dict() for k, v in ratios.items()}}


def print_table(report: dict) -> None:
    w = report["workload"]
    print(f"{w['streams']} streams over {w['replicas']} replicas ({w['long_streams']} with long prompts of "
          f"~{w['long_prompt_tokens']} tokens), median of {w['rounds']} rounds after {w['warm_rounds']} unmeasured")
    print(f"{'router':>8} {'eff tok/s':>10} {'raw tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'stall s':>8}  "
          "per replica")
    for name, r in report["routers"].items():
        print(f"{name:>8} {r['effective_tput']:>10.1f} {r['raw_tput']:>10.1f} {r['ttft_p50_s']:>9.3f} "
              f"{r['ttft_p99_s']:>9.3f} {r['stall_s']:>8.1f}  {r['per_replica_streams']}")
    paired = report.get("paired")
    if paired:
        print(f"{paired['a']} / {paired['b']}, round by round: geometric mean of the ratios "
              f"[{paired['level']:.0%} bootstrap interval], rounds {paired['a']} did better, verdict")
        for name, m in paired["metrics"].items():
            print(f"  {name:>14} {m['geo_mean']:.3f} [{m['low']:.3f}, {m['high']:.3f}]  "
                  f"{m['wins']}/{m['pairs']} (sign test p {m['sign_p']:.3f})  {m['verdict']}")

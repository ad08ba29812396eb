"""`tokenflow bench peer`: one seeded workload against our server (fcfs, then tokenflow) and then vLLM, compared.
`--workload conversations` is multi-turn chat behind a shared system prompt (conversations.py), our server with
prefix caching and without it (the `-nocache` systems) against vLLM with its own.

Everything that could differ is held equal: the model directory, the KV pool in bytes (ours in 16-token blocks,
vLLM's in its 128-token CPU blocks, both figures reported), the batch caps, the CPU threads (our replica's torch
threads, vLLM's OpenMP threads), the streams (prompt text, lengths, reader rates, arrival times) and the client:
the same PacedStreamClient and metric code measure all three from outside. The one difference is the consumption
reports: only our server has that route, so vLLM's streams send none (its readers are paced all the same).
Ray/Serve is shut down before vLLM starts, and vLLM only runs for its own turn, so neither takes CPU from the other.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import statistics
import string
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tokenflow_ray.client import LoadResult, StreamSpec, run_load
from tokenflow_ray.lab.peer.conversations import (
    ConversationResult,
    ConversationWorkload,
    print_conversations,
    run_conversations,
)
from tokenflow_ray.lab.peer.systems_table import systems_table
from tokenflow_ray.workloads.generators import LengthDist, RequestSpec, WorkloadSpec, make_requests

PEER_WORKLOADS = ("burst", "poisson", "mixed", "conversations")
# Also the run order: ours first, vLLM only for its own turn. `-nocache`: ours with prefix caching off.
SYSTEMS = ("fcfs", "tokenflow", "fcfs-nocache", "tokenflow-nocache", "vllm")
OURS = ("fcfs", "tokenflow", "fcfs-nocache", "tokenflow-nocache")


@dataclass(frozen=True)
class PeerBenchConfig:
    workload: str = "burst"  # burst | poisson | mixed (workloads/generators.py generators)
    streams: int = 64
    prompt_len: int = 64  # mean prompt tokens (byte-level tokenizer: one token per ASCII character)
    max_tokens: int = 256  # every stream generates exactly this many (ignore_eos), so systems do equal work
    rate: float = 20.0  # reader tokens/s (mixed: 40% at 0.75 x rate, 60% at rate)
    burst_s: float = 1.0  # burst/mixed: arrivals spread evenly over this long
    arrival_rate: float = 4.0  # poisson: requests/s
    # The paper's regime: the device pool holds a fraction of the burst at full length (480 x 16 tokens = 24 of 64
    # streams at 320 tokens), while Σ rates stays near the decode capacity.
    kv_blocks: int = 480  # our device KV pool in 16-token blocks; vLLM gets the same bytes
    host_blocks: int = 4096  # our CPU spill store (vLLM's CPU backend has no second tier: it recomputes)
    block_size: int = 16
    vllm_block_size: int = 128  # vLLM's CPU default
    max_model_len: int = 1024
    max_num_seqs: int = 0  # batch cap for both; 0: the number of streams
    max_num_batched_tokens: int = 512  # per-step token budget for both (our ServeConfig default)
    threads: int = 2  # our replica's num_cpus (= torch threads) and vLLM's OpenMP threads
    systems: tuple[str, ...] = SYSTEMS
    model: str = "embedded"  # also the served model name on both servers
    seed: int = 0
    timeout_s: float = 300.0  # per system, for the measured load
    ready_timeout_s: float = 300.0  # vLLM start-up (compiles on first start: ~30-60 s here)
    report_interval_s: float = 2.0  # our server's consumption reports (each costs ~3 ms of CPU across the stack)
    vllm_env: str | None = None  # None: cache_root()/peers/vllm-<version>, created if missing
    log_dir: str | None = None  # vLLM's server log goes here
    repeats: int = 1  # each figure is the median over this many rounds (systems take turns within a round)
    # conversations: `streams` conversations of `turns` turns behind a `system_len`-token system prompt, user
    # messages of `prompt_len` tokens, replies of `max_tokens`
    turns: int = 4
    system_len: int = 1024

    def __post_init__(self) -> None:
        if self.workload not in PEER_WORKLOADS:
            raise ValueError(f"workload: expected one of {', '.join(PEER_WORKLOADS)}, got {self.workload!r}")
        if not self.systems or set(self.systems) - set(SYSTEMS) or len(set(self.systems)) != len(self.systems):
            raise ValueError(f"systems: a non-empty selection of {', '.join(SYSTEMS)} without repeats, "
                             f"got {','.join(self.systems)!r}")
        object.__setattr__(self, "systems", tuple(s for s in SYSTEMS if s in self.systems))  # fixed run order
        for name in ("repeats", "streams", "prompt_len", "max_tokens", "kv_blocks", "block_size", "vllm_block_size",
                     "max_model_len", "max_num_batched_tokens", "threads", "turns", "system_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if not 0 < self.streams <= 1024:
            raise ValueError(f"streams: at most 1024 (the load generator's cap), got {self.streams}")
        if self.host_blocks < 0 or self.max_num_seqs < 0:
            raise ValueError("host_blocks and max_num_seqs: must be >= 0")
        for name in ("rate", "burst_s", "arrival_rate", "timeout_s", "ready_timeout_s", "report_interval_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}: must be a finite number >= 0, got {value!r}")
        if self.rate <= 0 or self.arrival_rate <= 0 or self.timeout_s <= 0 or self.ready_timeout_s <= 0 \
                or self.report_interval_s <= 0:
            raise ValueError("rate, arrival_rate, timeout_s, ready_timeout_s and report_interval_s: must be positive")
        if self.max_prompt_len + self.max_tokens > self.max_model_len:
            raise ValueError(f"prompt_len/max_tokens: the longest stream ({self.max_prompt_len} + {self.max_tokens} "
                             f"tokens) exceeds max_model_len={self.max_model_len}")
        if self.kv_blocks * self.block_size < self.max_prompt_len + self.max_tokens:
            raise ValueError(f"kv_blocks: {self.kv_blocks} x {self.block_size} tokens cannot hold one full stream")
        if "vllm" in self.systems and self.vllm_blocks * self.vllm_block_size < self.max_model_len:
            raise ValueError(f"kv_blocks: vLLM refuses a KV pool smaller than one max_model_len={self.max_model_len} "
                             f"request; need kv_blocks >= {-(-self.max_model_len // self.block_size)}")

    # ---- derived ---------------------------------------------------------------------------------------------

    @property
    def max_prompt_len(self) -> int:
        if self.workload == "conversations":
            return self.conversation_workload().max_prompt_len
        return self.prompt_len + self.prompt_len // 2  # the prompt length distribution's upper clamp

    def conversation_workload(self) -> ConversationWorkload:
        return ConversationWorkload(conversations=self.streams, turns=self.turns, system_len=self.system_len,
                                    user_len=self.prompt_len, max_tokens=self.max_tokens, seed=self.seed)

    @property
    def batch_cap(self) -> int:
        return self.max_num_seqs or self.streams

    @property
    def vllm_blocks(self) -> int:
        # Equal bytes (both fp32, same bytes/token), rounded to whole vLLM blocks: the two byte figures are reported.
        return max(1, round(self.kv_blocks * self.block_size / self.vllm_block_size))

    def workload_spec(self) -> WorkloadSpec:
        return WorkloadSpec(
            self.workload, self.streams, seed=self.seed, arrival_rate=self.arrival_rate, rate=self.rate,
            rate_mix=((0.75 * self.rate, 0.4), (self.rate, 0.6)),
            prompt=LengthDist(self.prompt_len, 0.25 * self.prompt_len, min_len=max(1, self.prompt_len // 2),
                              max_len=self.max_prompt_len),
            output=LengthDist(self.max_tokens, 0.0, min_len=self.max_tokens, max_len=self.max_tokens),
            length_scale=1.0)

    def requests(self) -> list[RequestSpec]:
        reqs = make_requests(self.workload_spec())
        if self.workload == "poisson":
            return reqs
        gap = self.burst_s / self.streams  # a burst is simultaneous in the generator; spread it like a real one
        return [replace(r, arrival_s=r.arrival_s + r.index * gap) for r in reqs]

    def specs(self) -> list[StreamSpec]:
        return [StreamSpec(prompt_text(self.seed, r.index, r.prompt_len), max_tokens=r.output_len, rate=r.rate,
                           start_s=r.arrival_s) for r in self.requests()]

    def warmup_specs(self) -> list[StreamSpec]:
        """Short unpaced streams first, so one-off start-up work is not in anyone's TTFT. Enough of them to fill a
        whole step's token budget: vLLM CPU compiles a graph per token-count range on first use."""
        n = max(4, min(self.streams, -(-self.max_num_batched_tokens // self.prompt_len)))
        return [StreamSpec(prompt_text(self.seed + 1, i, self.prompt_len), max_tokens=8) for i in range(n)]

    def serve_config(self, system: str):
        """Our server as `system` runs it: the policy, and prefix caching off for a `-nocache` system."""
        from tokenflow_ray.serve.config import ServeConfig, serve_engine

        policy, _, variant = system.partition("-")
        return ServeConfig(app_name="peer", num_cpus=self.threads, images=False,
                           engine=serve_engine(model=self.model, dtype="float32", policy=policy,
                                               enable_prefix_caching=variant != "nocache",
                                               num_device_blocks=self.kv_blocks, num_host_blocks=self.host_blocks,
                                               block_size=self.block_size, max_num_seqs=self.batch_cap,
                                               max_num_batched_tokens=self.max_num_batched_tokens))


def prompt_text(seed: int, index: int, length: int) -> str:
    """Seeded lowercase words, exactly `length` ASCII characters (= tokens with the byte-level tokenizer)."""
    rng = random.Random(f"{seed}:prompt:{index}")
    text = ""
    while len(text) < length:
        text += ("" if not text else " ") + "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 8)))
    return text[:length]


def kv_bytes_per_token(model_dir: Path, dtype_bytes: int = 4) -> int:
    """K and V, every layer, every KV head: layers x 2 x kv_heads x head_dim x bytes (fp32: 4)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return cfg["num_hidden_layers"] * 2 * cfg.get("num_key_value_heads", heads) * head_dim * dtype_bytes


# ---- the runs ------------------------------------------------------------------------------------------------


def _load(url: str, cfg: PeerBenchConfig, specs: list[StreamSpec], name: str,
          reports: float | None) -> LoadResult | ConversationResult:
    asyncio.run(run_load(url, cfg.warmup_specs(), model=cfg.model, timeout_s=120, report_interval_s=reports))
    if cfg.workload == "conversations":
        wl = cfg.conversation_workload()
        print(f"{name}: {wl.conversations} conversations x {wl.turns} turns", flush=True)
        return asyncio.run(run_conversations(url, wl, model=cfg.model, timeout_s=cfg.timeout_s))
    done = [0]

    def on_done(_) -> None:
        done[0] += 1
        if done[0] % max(1, len(specs) // 8) == 0 or done[0] == len(specs):
            print(f"  {name}: {done[0]}/{len(specs)} streams done", flush=True)

    print(f"{name}: {len(specs)} streams", flush=True)
    return asyncio.run(run_load(url, specs, model=cfg.model, timeout_s=cfg.timeout_s, report_interval_s=reports,
                                on_done=on_done))


def _children_alive() -> list[int]:
    me = str(os.getpid())
    alive = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()
            if fields[1] == me and fields[0] != "Z":
                alive.append(int(entry))
    return alive


def run_ours(cfg: PeerBenchConfig, specs: list[StreamSpec]) -> dict[str, LoadResult]:
    from tokenflow_ray.serve.app import deploy, undeploy
    from tokenflow_ray.serve.local import local_serve

    runs: dict[str, LoadResult] = {}
    policies = [s for s in cfg.systems if s in OURS]
    if not policies:
        return runs
    with local_serve(num_cpus=cfg.threads + 2) as url:  # the replica's CPUs + headroom for the ingress and proxy
        for policy in policies:
            sc = cfg.serve_config(policy)
            deploy(sc)
            try:
                runs[policy] = _load(url, cfg, specs, policy, cfg.report_interval_s)
            finally:
                undeploy(sc)
    deadline = time.monotonic() + 30  # Ray's processes (children of this one) must be gone before vLLM starts
    while _children_alive() and time.monotonic() < deadline:
        time.sleep(0.5)
    return runs


def run_vllm(cfg: PeerBenchConfig, specs: list[StreamSpec], python: Path, model_dir: Path,
             log_dir: Path) -> tuple[LoadResult, list[str]]:
    from tokenflow_ray.lab.peer.vllm_server import VllmServerSettings, vllm_server, vllm_server_argv

    settings = VllmServerSettings(python=python, model_dir=model_dir, served_model_name=cfg.model,
                                  num_blocks=cfg.vllm_blocks, block_size=cfg.vllm_block_size,
                                  max_model_len=cfg.max_model_len, max_num_seqs=cfg.batch_cap,
                                  max_num_batched_tokens=cfg.max_num_batched_tokens, threads=cfg.threads,
                                  prefix_caching=True if cfg.workload == "conversations" else None)
    log_path = log_dir / "vllm_server.log"
    print(f"vllm: starting the server (log: {log_path})", flush=True)
    start = time.monotonic()
    with vllm_server(settings, log_path, cfg.ready_timeout_s) as url:
        print(f"vllm: ready in {time.monotonic() - start:.0f} s at {url}", flush=True)
        result = _load(url, cfg, specs, "vllm", None)  # vLLM has no consumption-report route
    return result, vllm_server_argv(settings, int(url.rsplit(":", 1)[1]))[2:]


def system_summary(res: LoadResult | ConversationResult) -> dict:
    if isinstance(res, ConversationResult):
        return res.summary()
    s = res.summary().to_dict()
    keys = ("ttft_p50_s", "ttft_p99_s", "effective_tput", "raw_tput", "stall_s", "qoe_mean", "ttft_mean_s",
            "tbt_p50_s", "tbt_p99_s", "makespan_s", "stall_per_stream_mean_s")
    errors = Counter(r.error.split(":")[0] for r in res.results if r.error)
    return {**{k: s[k] for k in keys}, "complete": res.num_complete, "streams": len(res.results),
            "tokens": res.total_tokens, "wall_s": res.wall_s, "errors": dict(errors),
            # as the server counted them (usage.prompt_tokens): equal across systems = the same tokenization
            "prompt_tokens": sum(r.prompt_len for r in res.records),
            "report_errors": sum(len(r.report_errors) for r in res.results)}


def median_summary(rounds: list[dict]) -> dict:
    """Per figure, the median over rounds (numbers); the last round's value otherwise. `rounds` keeps the headline
    figures of every round, so the spread is in the JSON."""
    out = dict(rounds[-1])
    for key, value in rounds[-1].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = statistics.median(r[key] for r in rounds)
    keys = ("later_ttft_p50_s", "later_ttft_p99_s", "later_cached_share") if "later_ttft_p50_s" in out else (
        "ttft_p99_s", "effective_tput", "raw_tput", "stall_s")
    out["rounds"] = {k: [r[k] for r in rounds] for k in keys}
    return out


def run_peer_bench(cfg: PeerBenchConfig) -> tuple[dict, dict[str, LoadResult]]:
    """The JSON report and the raw runs (for the plots). A failed vLLM turn is recorded, not raised."""
    from tokenflow_ray.lab.peer.vllm_env import VLLM_VERSION, PeerError, ensure_vllm_env
    from tokenflow_ray.lab.peer.vllm_server import vllm_cpu_env
    from tokenflow_ray.models.loader import resolve_model_dir

    start = time.monotonic()
    model_dir = resolve_model_dir(cfg.model)
    per_token = kv_bytes_per_token(model_dir)
    python = ensure_vllm_env(cfg.vllm_env) if "vllm" in cfg.systems else None  # fail or install before ours runs
    log_dir = Path(cfg.log_dir or "out/peer")
    log_dir.mkdir(parents=True, exist_ok=True)
    specs = [] if cfg.workload == "conversations" else cfg.specs()

    rounds: dict[str, list[dict]] = {}
    runs: dict[str, LoadResult] = {}  # the last round's, for the plots
    vllm_info: dict = {}
    vllm_error: str | None = None
    for repeat in range(cfg.repeats):
        if cfg.repeats > 1:
            print(f"round {repeat + 1}/{cfg.repeats}", flush=True)
        runs = run_ours(cfg, specs)
        if python is not None:
            vllm_info = {"version": VLLM_VERSION, "python": str(python), "env": vllm_cpu_env(cfg.threads),
                         "log": str(log_dir / "vllm_server.log")}
            try:
                runs["vllm"], vllm_info["args"] = run_vllm(cfg, specs, python, model_dir, log_dir)
            except PeerError as exc:
                print(f"vllm: {exc}", flush=True)
                vllm_error = str(exc)
        for name, res in runs.items():
            rounds.setdefault(name, []).append(system_summary(res))
    systems = {name: median_summary(rounds[name]) for name in SYSTEMS if name in rounds}
    if python is not None and "vllm" not in systems:
        systems["vllm"] = {"error": vllm_error}

    report = {
        "systems": systems,
        "workload": _workload_dict(cfg),
        "kv": {"bytes_per_token": per_token, "ours_blocks": cfg.kv_blocks, "ours_block_size": cfg.block_size,
               "ours_bytes": cfg.kv_blocks * cfg.block_size * per_token, "ours_host_blocks": cfg.host_blocks,
               "vllm_blocks": cfg.vllm_blocks, "vllm_block_size": cfg.vllm_block_size,
               "vllm_bytes": cfg.vllm_blocks * cfg.vllm_block_size * per_token,
               # vLLM's block pool keeps one block back as its null block; ours uses every block.
               "ours_usable_tokens": cfg.kv_blocks * cfg.block_size,
               "vllm_usable_tokens": (cfg.vllm_blocks - 1) * cfg.vllm_block_size},
        "config": {**asdict(cfg), "model_dir": str(model_dir), "batch_cap": cfg.batch_cap,
                   "ours": {"replicas": 1, "num_cpus": cfg.threads, "torch_threads": cfg.threads,
                            "stream_interval_s": cfg.serve_config("fcfs").stream_interval_s},
                   "vllm": vllm_info},
        "wall_s": time.monotonic() - start,
    }
    return report, runs


def _workload_dict(cfg: PeerBenchConfig) -> dict:
    if cfg.workload == "conversations":
        return {"name": cfg.workload, **asdict(cfg.conversation_workload()),
                "max_prompt_tokens": cfg.max_prompt_len}
    reqs = cfg.requests()
    return {"name": cfg.workload, "streams": cfg.streams, "seed": cfg.seed, "max_tokens": cfg.max_tokens,
            "prompt_tokens_mean": sum(r.prompt_len for r in reqs) / len(reqs),
            "prompt_tokens_min": min(r.prompt_len for r in reqs),
            "prompt_tokens_max": max(r.prompt_len for r in reqs),
            "rates": {str(k): v for k, v in sorted(Counter(r.rate for r in reqs).items())},
            "sum_rates": sum(r.rate for r in reqs), "last_arrival_s": max(r.arrival_s for r in reqs),
            "burst_s": cfg.burst_s if cfg.workload != "poisson" else None,
            "arrival_rate": cfg.arrival_rate if cfg.workload == "poisson" else None}


def print_table(report: dict) -> str:
    if report["workload"]["name"] == "conversations":
        return print_conversations(report)
    w, kv = report["workload"], report["kv"]
    return systems_table(
        f"{w['name']}: {w['streams']} streams x {w['max_tokens']} tokens, readers {w['rates']} tok/s, "
        f"KV {kv['ours_bytes'] / 2**20:.1f} MiB (ours) / {kv['vllm_bytes'] / 2**20:.1f} MiB (vLLM)",
        [("TTFT p50 (s)", "ttft_p50_s", ".2f"), ("TTFT p99 (s)", "ttft_p99_s", ".2f"),
         ("effective tok/s", "effective_tput", ".1f"), ("raw tok/s", "raw_tput", ".1f"), ("stall (s)", "stall_s", ".1f")],
        report["systems"], lambda p: f"{p['complete']}/{p['streams']}")

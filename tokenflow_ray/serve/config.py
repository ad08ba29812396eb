"""ServeConfig: the one frozen, validated config of the Serve app, loadable from a Serve config YAML.

The YAML that `serve run`/`serve deploy` accept (`applications: [{import_path: tokenflow_ray.serve.app:app_builder,
args: {...}}]`, `http_options: {host, port}`) is also what `tokenflow serve --config` reads: `args` are these fields.

The replicas' engine is one nested EngineConfig (`engine`), the server's defaults over the engine's own
(`serve_engine`: the tokenflow policy and a host spill store). In YAML, `engine:` takes engine options by name
(`engine: {model: embedded, policy: tokenflow, num_device_blocks: 1024}`, or parts: `engine: {cache: {...}}`).
Files written before the nesting put those options flat in `args` (`model: ..., num_device_blocks: ...`): they are
still read, each option into `engine` (the same option in both places is an error). Defaults that depend on the
replicas' device (the block size on CUDA with flash-attn, overlapped scheduling) are resolved here, once, before
admission or a replica reads the engine config (runner/device_defaults.py).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from tokenflow_ray.checks import require
from tokenflow_ray.engine.config import CacheConfig, EngineConfig, SchedulerConfig, engine_option_names
from tokenflow_ray.runner.device_defaults import DeviceFacts, resolve_device_defaults
from tokenflow_ray.serve.control.autoscaling_policy import AutoscalingSettings
from tokenflow_ray.serve.replica.admission import Admission, admission
from tokenflow_ray.serve.replica.fleet import engine_config_for_rank
from tokenflow_ray.serve.replica.grouping import GroupingConfig

ROUTERS = ("default", "slack")
HTTP_PLACEMENTS = ("direct", "ingress")


def serve_engine(**options: Any) -> EngineConfig:
    """A replica's engine: the engine's defaults, but the tokenflow policy and a 4096-block host spill store per
    replica (host memory is the cheap tier), with `options` by name (EngineConfig.with_options)."""
    base = EngineConfig(cache=CacheConfig(num_host_blocks=4096), scheduler=SchedulerConfig(policy="tokenflow"))
    return base.with_options(**options)


def images_available() -> bool:
    return importlib.util.find_spec("tokenflow_ray.serve.http.images") is not None


def replica_device_facts(device: str, num_gpus: float) -> DeviceFacts:
    """What a replica's engine will find, decided where the app is built: Ray hands a replica a GPU only when it
    asks for one (num_gpus > 0), so device auto is CUDA exactly then; flash-attn is taken as installed on the
    replicas' nodes when it is here (one image across the cluster)."""
    cuda = device.startswith("cuda") or (device == "auto" and num_gpus > 0)
    return DeviceFacts(cuda=cuda, flash_attn=cuda and importlib.util.find_spec("flash_attn") is not None)


@dataclass(frozen=True)
class ServeConfig:
    app_name: str = "tokenflow"
    route_prefix: str = "/"
    # The replicas' engine (model, KV pool and host store, batch, policy, ...): serve_engine() and the module doc.
    engine: EngineConfig = field(default_factory=serve_engine)
    replicas: int = 1
    # A mixed fleet: the replica of Serve rank i holds a device pool of device_blocks_by_rank[i] blocks (ranks past
    # the list: the engine's num_device_blocks), as replicas on GPUs of different memory hold different pools. On one
    # CPU box it is how a bench puts such a fleet behind one router (`tokenflow bench routing --device-blocks
    # 384,128`). Admission still derives from the engine's pool. (): every replica alike.
    device_blocks_by_rank: tuple[int, ...] = ()
    # Admission (replica/admission.py). A replica accepts the streams its device pool + host store can keep at
    # expected_stream_tokens (prompt + output) each, at least max_num_seqs; Serve queues at most
    # max_queued_requests more per caller (None: a quarter of what the replicas hold; -1: unbounded), and answers
    # the rest 429 with Retry-After: retry_after_s. In the direct placement those streams of the expected size make a
    # budget of KV blocks, and each stream claims its own prompt + max_tokens against it.
    expected_stream_tokens: int = 512
    max_ongoing_requests: int | None = None  # per replica; None: derived from the working set
    max_queued_requests: int | None = None
    retry_after_s: int = 1
    # A consumption report may beat its stream's (asynchronous) registration to the central actor: it waits up to
    # this long for it before answering 404.
    register_grace_s: float = 2.0
    # The consumption rate of a request that declares none (tokens/s; 0: unpaced), resolved where a request comes in
    # (the HTTP routes, the request router): every stream reaches a replica's engine with its rate.
    default_rate: float = 0.0
    default_max_tokens: int = 16  # OpenAI's default for completions
    # The first token goes at once; later ones are grouped at least stream_interval_s and at most
    # stream_max_interval_s: half a paced reader's buffer time, or a share of the replica's stream_events_per_s
    # (each SSE item costs ~1 ms of CPU across proxy, ingress and replica), which a stream whose tokens outpace its
    # reader gets only as far as its buffer covers with stream_interval_s to spare. See replica/grouping.py.
    stream_interval_s: float = 0.05
    stream_max_interval_s: float = 0.5
    stream_events_per_s: float = 150.0
    num_cpus: float = 1.0  # per replica (Ray also sets the replica's torch threads from it)
    num_gpus: float = 0.0  # per replica
    # >0: pin each replica's process to this many CPUs of its own (by its local rank on the node; affinity.py),
    # as a GPU replica owns its device: unpinned on one box, replicas share every core and are one pooled
    # capacity. A replica whose slice does not fit on its node runs unpinned (logged). 0: no pinning.
    pin_cpus: int = 0
    # Who answers HTTP (http/ingress.py): "direct", the replicas themselves (one hop between engine and socket; a
    # dead replica's connections just end), or "ingress", a separate deployment in front (one more hop; a dead
    # replica's streams get 503 / an error event). ingress_max_ongoing bounds that deployment's concurrency.
    http: str = "direct"
    ingress_max_ongoing: int = 2048
    api_key: str | None = None  # set: /v1/* needs `Authorization: Bearer <api_key>`
    max_body_bytes: int = 1 << 20  # larger request bodies get 413
    host: str = "127.0.0.1"
    port: int = 8000
    central_namespace: str = "tokenflow"
    # Share another app's central actor (its app_name): replicas of both are then one cluster to the migration
    # policy (a stream can move between them). "": this app's own.
    central_app: str = ""
    images: bool | None = None  # bind the image tokenizer routes; None: when tokenflow_ray.serve.http.images exists
    tokenizer_dir: str | None = None  # an image tokenizer (save_pretrained / export dir); None: the packaged one
    # How the LLMServer handle picks a replica for a new stream: "default" is Serve's power-of-two-choices on
    # queue length; "slack" is the buffer-slack router (serve/control/slack_router.py, cluster/routing.py). Replicas
    # publish their ReplicaStats to Serve every routing_stats_period_s under either router.
    router: str = "default"
    routing_stats_period_s: float = 0.5
    # Autoscaling of the LLMServer replicas on serving signals (serve/control/autoscaling_policy.py): None keeps `replicas`
    # fixed; a mapping (min_replicas, max_replicas, delays, metrics_interval_s, ... in YAML) becomes
    # AutoscalingSettings, and `replicas` is the initial count within [min_replicas, max_replicas].
    autoscaling: AutoscalingSettings | None = None
    # Live migration of paused streams between replicas (serve/http/stream_port.py): each replica keeps a port for
    # it. None: on when more than one replica can exist (replicas > 1, or autoscaling).
    migration: bool | None = None
    migrate_waiting: bool = False  # the policy moves streams waiting to start too, after paused ones

    def __post_init__(self) -> None:
        require(isinstance(self.engine, EngineConfig), "engine: must be an EngineConfig (serve_engine(...)); "
                                                      "ServeConfig.from_dict reads a mapping of engine options")
        require(self.num_cpus >= 0 and self.num_gpus >= 0, "num_cpus/num_gpus: must be >= 0")
        # Once, here: admission below and every replica read the engine config as the replicas' device runs it.
        object.__setattr__(self, "engine", resolve_device_defaults(
            self.engine, replica_device_facts(self.engine.model.device, self.num_gpus)))
        if self.images is None:
            object.__setattr__(self, "images", images_available())
        require(isinstance(self.device_blocks_by_rank, (list, tuple))
                and all(isinstance(n, int) and not isinstance(n, bool) and n > 0
                        for n in self.device_blocks_by_rank),
                "device_blocks_by_rank: must be a list of positive ints (a device pool per replica rank)")
        object.__setattr__(self, "device_blocks_by_rank", tuple(self.device_blocks_by_rank))
        require(bool(self.app_name) and self.app_name.replace("-", "_").isidentifier(),
                "app_name: letters, digits, '_' or '-'")
        require(self.route_prefix.startswith("/"), "route_prefix: must start with '/'")
        require(self.replicas >= 1, "replicas: must be >= 1")
        if self.autoscaling is not None:
            object.__setattr__(self, "autoscaling", AutoscalingSettings.from_value(self.autoscaling))
            require(self.autoscaling.min_replicas <= self.replicas <= self.autoscaling.max_replicas,
                    "replicas: the initial count must be within [autoscaling.min_replicas, max_replicas]")
        require(isinstance(self.default_rate, (int, float)) and math.isfinite(self.default_rate)
                and self.default_rate >= 0, "default_rate: must be a finite number >= 0")
        require(self.default_max_tokens > 0, "default_max_tokens: must be positive")
        self.grouping()  # validates the stream interval fields
        require(self.expected_stream_tokens >= 1, "expected_stream_tokens: must be >= 1")
        require(self.max_ongoing_requests is None or self.max_ongoing_requests >= self.engine.scheduler.max_num_seqs,
                "max_ongoing_requests: must be >= max_num_seqs (the engine's batch must be fillable)")
        require(self.max_queued_requests in (None, -1) or self.max_queued_requests >= 1,
                "max_queued_requests: must be >= 1, or -1 for unbounded")
        require(self.retry_after_s >= 0, "retry_after_s: must be >= 0")
        require(math.isfinite(self.register_grace_s) and self.register_grace_s >= 0,
                "register_grace_s: must be a finite number >= 0")
        # Every request the replicas could hold or queue must get through the ingress to the LLMServer router:
        # one held back in the ingress's own (unbounded) queue is neither scheduled nor ever answered 429.
        adm = self.admission()
        most = self.replicas if self.autoscaling is None else self.autoscaling.max_replicas
        reachable = most * adm.max_ongoing_requests + max(0, adm.max_queued_requests)
        require(self.http in HTTP_PLACEMENTS,
                f"http: must be one of {', '.join(HTTP_PLACEMENTS)}, got {self.http!r}")
        require(self.http != "ingress" or self.ingress_max_ongoing >= reachable,
                "ingress_max_ongoing: must be >= (max_)replicas x max_ongoing_requests + max_queued_requests")
        require(self.api_key is None or len(self.api_key) > 0, "api_key: must be non-empty when set")
        require(self.max_body_bytes >= 1024, "max_body_bytes: must be >= 1024")
        require(isinstance(self.pin_cpus, int) and not isinstance(self.pin_cpus, bool) and self.pin_cpus >= 0,
                "pin_cpus: must be an int >= 0 (CPUs each replica is pinned to; 0: none)")
        require(self.router in ROUTERS, f"router: must be one of {', '.join(ROUTERS)}, got {self.router!r}")
        require(isinstance(self.routing_stats_period_s, (int, float)) and math.isfinite(self.routing_stats_period_s)
                and self.routing_stats_period_s > 0, "routing_stats_period_s: must be a finite number > 0")
        require(0 <= self.port < 65536, "port: must be in [0, 65535]")
        require(not (self.images and not images_available()), "images: tokenflow_ray.serve.http.images is missing")
        require(self.tokenizer_dir is None or (Path(self.tokenizer_dir).expanduser() / "config.json").is_file(),
                f"tokenizer_dir: {self.tokenizer_dir} is not a saved tokenizer (no config.json)")
        require(self.tokenizer_dir is None or bool(self.images), "tokenizer_dir: needs images on")

    @property
    def central_actor_name(self) -> str:
        from tokenflow_ray.serve.control.central import central_name

        return central_name(self.central_app or self.app_name)

    @property
    def migration_enabled(self) -> bool:
        if self.migration is not None:
            return bool(self.migration)
        return self.replicas > 1 or (self.autoscaling is not None and self.autoscaling.max_replicas > 1)

    def admission(self) -> Admission:
        ec = self.engine
        return admission(max_num_seqs=ec.scheduler.max_num_seqs, num_device_blocks=ec.cache.num_device_blocks,
                         num_host_blocks=ec.cache.num_host_blocks, block_size=ec.cache.block_size,
                         expected_stream_tokens=self.expected_stream_tokens, replicas=self.replicas,
                         max_ongoing_requests=self.max_ongoing_requests,
                         max_queued_requests=self.max_queued_requests)

    def grouping(self) -> GroupingConfig:
        return GroupingConfig(self.stream_interval_s, self.stream_max_interval_s, self.stream_events_per_s)

    def engine_config(self, rank: int | None = None) -> EngineConfig:
        """The engine config of the replica at Serve rank `rank` (None: the fleet's default)."""
        return self.engine if rank is None else engine_config_for_rank(self.engine, self.device_blocks_by_rank, rank)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], **overrides: Any) -> ServeConfig:
        """These fields by name, `engine` a mapping of engine options (or flat engine options: the module doc);
        `overrides` (None: not given) win over `data`, an engine option's too."""
        known = {f.name for f in fields(cls)}
        engine_options = engine_option_names()
        unknown = sorted(set(data) - known - engine_options)
        if unknown:
            raise ValueError(f"unknown ServeConfig keys: {unknown}; known: {sorted(known)}, and engine options "
                             f"(under engine:): {sorted(engine_options)}")
        engine = data.get("engine") or {}
        require(isinstance(engine, Mapping), "engine: must be a mapping of engine options")
        flat = {k: v for k, v in data.items() if k not in known}
        for key in sorted(set(flat) & set(engine)):
            raise ValueError(f"{key}: given both flat and under engine:; keep the one under engine:")
        given = {k: v for k, v in overrides.items() if v is not None}
        serve_fields = {k: v for k, v in {**data, **given}.items() if k in known and k != "engine"}
        engine_config = serve_engine(**engine, **flat).with_options(
            **{k: v for k, v in given.items() if k not in known})
        return cls(engine=engine_config, **serve_fields)

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> ServeConfig:
        """A Serve config YAML (first application's args + http_options) or a flat mapping of these fields."""
        import yaml

        doc = yaml.safe_load(Path(path).read_text()) or {}
        if "applications" in doc:
            apps = doc["applications"]
            require(len(apps) == 1, "config: expected exactly one application")
            app = apps[0]
            data = dict(app.get("args") or {})
            data.setdefault("app_name", app.get("name", cls.app_name))
            data.setdefault("route_prefix", app.get("route_prefix", cls.route_prefix))
            for key in ("host", "port"):
                if key in (doc.get("http_options") or {}):
                    data.setdefault(key, doc["http_options"][key])
        else:
            data = dict(doc)
        return cls.from_dict(data, **overrides)

"""build_app(config) -> the Serve Application: LLMServer replicas answering HTTP (or an OpenAIIngress in front of
them: ServeConfig.http), the image tokenizer, and the central actor's name.

`app_builder(args)` is the import path for Serve config YAMLs (`serve run`/`serve deploy`):
    applications: [{name: tokenflow, import_path: tokenflow_ray.serve.app:app_builder, args: {model: embedded}}]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter
from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from tokenflow_ray.cluster.migration_policy import MigrationSettings
from tokenflow_ray.cluster.routing import SlackRouterConfig
from tokenflow_ray.serve.config import ServeConfig
from tokenflow_ray.serve.control.central import CentralSettings
from tokenflow_ray.serve.http.ingress import IngressSettings, make_http_class, make_ingress
from tokenflow_ray.serve.replica.admission import CONTROL_SLOTS, direct_kv_budget, direct_proxy_queue
from tokenflow_ray.serve.replica.server import LLMServer, ReplicaSettings

IMAGE_DEPLOYMENT = "ImageTokenizerDeployment"
SLACK_ROUTER_PATH = "tokenflow_ray.serve.control.slack_router.SlackRequestRouter"
DRAINED_EXIT_POLL_S = 0.5  # how often a replica Serve is stopping checks whether its streams are gone


def build_app(config: ServeConfig, routers: Sequence[APIRouter] = ()) -> Application:
    """`routers` is the seam for extra routes; the image tokenizer's are added when config.images is set."""
    central = CentralSettings(config.central_actor_name, config.central_namespace,
                              register_grace_s=config.register_grace_s,
                              migration=MigrationSettings(move_waiting=config.migrate_waiting)
                              if config.migration_enabled else None)
    adm = config.admission()
    direct = config.http == "direct"
    extra: list[Any] = []
    routers = list(routers)
    if config.images:
        from tokenflow_ray.serve.http.images import ImageTokenizerDeployment, image_routes

        app_name = config.app_name
        routers.append(image_routes(lambda: serve.get_deployment_handle(IMAGE_DEPLOYMENT, app_name),
                                    api_key=config.api_key))
        extra.append(ImageTokenizerDeployment.bind(model_dir=config.tokenizer_dir))  # deployed with the app
    http = IngressSettings(model=config.engine.model.model, default_max_tokens=config.default_max_tokens,
                           max_body_bytes=config.max_body_bytes, api_key=config.api_key, central=central,
                           default_rate=config.default_rate)
    kv_budget = direct_kv_budget(adm, config.replicas, config.engine.cache.block_size, config.expected_stream_tokens)
    replica = ReplicaSettings(central, grouping=config.grouping(),
                              torch_threads=max(1, int(config.num_cpus)) if config.num_cpus >= 1 else 0,
                              pin_cpus=config.pin_cpus, device_blocks_by_rank=config.device_blocks_by_rank,
                              routing_stats_interval_s=config.routing_stats_period_s,
                              kv_budget_blocks=kv_budget if direct else 0,
                              retry_after_s=config.retry_after_s, migration=config.migration_enabled,
                              **({} if config.autoscaling is None
                                 else {"critical_buffer_s": config.autoscaling.critical_buffer_s}))
    if direct:
        # The replica holds its share of the queue in its engine and answers 429 itself past it (replica/admission.py);
        # Serve's slots above that are for reports and the other small routes.
        # A stream claims at least one block, so the budget bounds the streams a replica takes.
        ongoing = (kv_budget or adm.max_ongoing_requests) + CONTROL_SLOTS
        most = config.replicas if config.autoscaling is None else config.autoscaling.max_replicas
        queued = direct_proxy_queue(kv_budget, most)
    else:
        # A replica takes every stream its working set can hold, not just a batch (replica/admission.py; Serve's default
        # of 5 would cap even the batch, ray-notes §6.1): streams beyond the batch wait in the engine, where the
        # policy ranks them. Past the bounded queue the handle raises BackPressureError; the ingress answers 429.
        ongoing, queued = adm.max_ongoing_requests, adm.max_queued_requests
    cls = make_http_class(LLMServer, routers) if direct else LLMServer
    llm = serve.deployment(cls, name="LLMServer").options(
        **replica_count_options(config),
        max_ongoing_requests=ongoing,
        max_queued_requests=queued,
        backpressure_config={"status_code": 429, "retry_after_s": config.retry_after_s},
        ray_actor_options={"num_cpus": config.num_cpus, "num_gpus": config.num_gpus},
        # The controller learns of a dead replica only from its next health check (on a dead actor it fails at
        # once), so the period bounds how long the replica goes unreplaced. With one replica the next request waits
        # that plus the restart: 12.6-13.7 s at 10 s (17.7 s by hand), 4.8-7.3 s at 2 s (tests/serve/test_faults.py);
        # other live replicas serve it at once either way. A check is one no-op engine-thread call (replica/server.py).
        health_check_period_s=2,
        health_check_timeout_s=60,
        request_router_config=request_router_config(config),
    )
    if direct:
        return llm.bind(config.engine_config(), replica, http, *extra)
    ingress = serve.deployment(make_ingress(routers), name="OpenAIIngress").options(
        max_ongoing_requests=config.ingress_max_ongoing,
        ray_actor_options={"num_cpus": 0},
    )
    return ingress.bind(llm.bind(config.engine_config(), replica), http, *extra)


def replica_count_options(config: ServeConfig) -> dict[str, Any]:
    """A fixed `replicas`, or autoscaling on serving signals (serve/control/autoscaling_policy.py) from `replicas` within
    [min, max]. A replica Serve picks for scale-down keeps serving its streams (graceful shutdown, up to
    drain_timeout_s) while the central actor moves them off it (migration): a scale-down never cuts a stream."""
    if config.autoscaling is None:
        return {"num_replicas": config.replicas}
    # A stopping replica checks its ongoing requests every graceful_shutdown_wait_loop_s (Serve's default: 2 s). A
    # drained one has none soon after its streams moved, and should free its CPUs then, not up to 2 s later.
    return {"autoscaling_config": config.autoscaling.serve_autoscaling_config(initial_replicas=config.replicas),
            "graceful_shutdown_timeout_s": config.autoscaling.drain_timeout_s,
            "graceful_shutdown_wait_loop_s": DRAINED_EXIT_POLL_S}


def request_router_config(config: ServeConfig) -> RequestRouterConfig:
    """Both routers get the replicas' stats at the same period, so comparing them changes only the decision."""
    period = config.routing_stats_period_s
    # A replica answers from its cache (replica/stats.py), so a poll that takes long means a stuck replica.
    common = {"request_routing_stats_period_s": period, "request_routing_stats_timeout_s": max(5.0, 10 * period)}
    if config.router == "default":
        return RequestRouterConfig(**common)
    slack = SlackRouterConfig(default_rate=config.default_rate,
                              # The embedded model's tokenizer is byte-level; real BPE tokenizers average ~4 bytes.
                              bytes_per_token=1.0 if config.engine.model.model == "embedded" else 4.0)
    return RequestRouterConfig(request_router_class=SLACK_ROUTER_PATH, request_router_kwargs=asdict(slack), **common)


def app_builder(args: dict[str, Any]) -> Application:
    return build_app(ServeConfig.from_dict(dict(args)))


def deploy(config: ServeConfig, blocking: bool = False) -> None:
    """serve.run with the config's name and route prefix (Serve must already be started with its HTTP options)."""
    serve.run(build_app(config), name=config.app_name, route_prefix=config.route_prefix, blocking=blocking)


def undeploy(config: ServeConfig) -> None:
    from tokenflow_ray.serve.control.central import kill_central

    serve.delete(config.app_name)
    kill_central(config.central_actor_name, config.central_namespace)

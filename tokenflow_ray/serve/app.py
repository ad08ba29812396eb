"""build_app(config) -> the Serve Application: OpenAIIngress -> LLMServer replicas, plus the central actor's name.

`app_builder(args)` is the import path for Serve config YAMLs (`serve run`/`serve deploy`):
    applications: [{name: tokenflow, import_path: tokenflow_ray.serve.app:app_builder, args: {model: embedded}}]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter
from ray import serve
from ray.serve import Application

from tokenflow_ray.serve.central import CentralSettings, central_name
from tokenflow_ray.serve.config import ServeConfig
from tokenflow_ray.serve.ingress import IngressSettings, make_ingress
from tokenflow_ray.serve.replica import LLMServer, ReplicaSettings

IMAGE_DEPLOYMENT = "ImageTokenizerDeployment"


def build_app(config: ServeConfig, routers: Sequence[APIRouter] = ()) -> Application:
    """`routers` is the seam for extra routes; the image tokenizer's are added when config.images is set."""
    central = CentralSettings(central_name(config.app_name), config.central_namespace,
                              register_grace_s=config.register_grace_s)
    adm = config.admission()
    llm = serve.deployment(LLMServer, name="LLMServer").options(
        num_replicas=config.replicas,
        # A replica takes every stream its working set can hold, not just a batch (admission.py; Serve's default
        # of 5 would cap even the batch, ray-notes §6.1): streams beyond the batch wait in the engine, where the
        # policy ranks them. Past the bounded queue the handle raises BackPressureError; the ingress answers 429.
        max_ongoing_requests=adm.max_ongoing_requests,
        max_queued_requests=adm.max_queued_requests,
        backpressure_config={"status_code": 429, "retry_after_s": config.retry_after_s},
        ray_actor_options={"num_cpus": config.num_cpus, "num_gpus": config.num_gpus},
        health_check_period_s=10,
        health_check_timeout_s=60,
    ).bind(config.engine_config(),
           ReplicaSettings(central, grouping=config.grouping(),
                           torch_threads=max(1, int(config.num_cpus)) if config.num_cpus >= 1 else 0))
    extra: list[Any] = []
    routers = list(routers)
    if config.images:
        from tokenflow_ray.serve.images import ImageTokenizerDeployment, image_routes

        app_name = config.app_name
        routers.append(image_routes(lambda: serve.get_deployment_handle(IMAGE_DEPLOYMENT, app_name)))
        extra.append(ImageTokenizerDeployment.bind())  # bound so it is deployed with the app
    ingress = serve.deployment(make_ingress(routers), name="OpenAIIngress").options(
        max_ongoing_requests=config.ingress_max_ongoing,
        ray_actor_options={"num_cpus": 0},
    )
    settings = IngressSettings(model=config.model, default_max_tokens=config.default_max_tokens,
                               max_body_bytes=config.max_body_bytes, api_key=config.api_key, central=central)
    return ingress.bind(llm, settings, *extra)


def app_builder(args: dict[str, Any]) -> Application:
    return build_app(ServeConfig.from_dict(dict(args)))


def deploy(config: ServeConfig, blocking: bool = False) -> None:
    """serve.run with the config's name and route prefix (Serve must already be started with its HTTP options)."""
    serve.run(build_app(config), name=config.app_name, route_prefix=config.route_prefix, blocking=blocking)


def undeploy(config: ServeConfig) -> None:
    from tokenflow_ray.serve.central import kill_central

    serve.delete(config.app_name)
    kill_central(central_name(config.app_name), config.central_namespace)

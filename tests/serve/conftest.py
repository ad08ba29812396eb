"""One Ray instance and one Serve app per test session (a Serve cycle costs 10-20 s; ray-notes §6.6)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import pytest

API_KEY = "test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class ServedApp:
    base_url: str
    api_key: str
    config: object  # ServeConfig

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def llm_handle(self):
        from ray import serve

        return serve.get_deployment_handle("LLMServer", self.config.app_name)


@pytest.fixture(scope="session")
def ray_serve():
    os.environ.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    import ray
    from ray import serve

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=4, include_dashboard=False, namespace=f"t{os.getpid()}", log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    if started:
        ray.shutdown()


@pytest.fixture(scope="session")
def app(ray_serve) -> ServedApp:
    from tokenflow_ray.serve.app import deploy, undeploy
    from tokenflow_ray.serve.config import ServeConfig

    # Room for the 256-stream load test in one engine batch; a host store so disconnects can be checked there too.
    config = ServeConfig(app_name="tftest", policy="fcfs", api_key=API_KEY, max_num_seqs=256,
                         max_num_batched_tokens=1024, num_device_blocks=1024, num_host_blocks=64,
                         max_body_bytes=64 * 1024, images=False, num_cpus=1)
    deploy(config)
    yield ServedApp(ray_serve, API_KEY, config)
    undeploy(config)

"""One Serve app per test session on the session-wide Ray and Serve of tests/conftest.py."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

API_KEY = "test-key"


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


def central_actor(config):
    """The app's central scheduling actor (created with the app: deploy first)."""
    import ray

    from tokenflow_ray.serve.control.central import central_name

    return ray.get_actor(central_name(config.app_name), namespace=config.central_namespace)


@pytest.fixture(scope="session")
def ray_serve(serve_url) -> str:
    return serve_url


@pytest.fixture(scope="session")
def app(ray_serve) -> ServedApp:
    from tokenflow_ray.serve.app import deploy, undeploy
    from tokenflow_ray.serve.config import ServeConfig, serve_engine

    # Room for the 256-stream load test in one engine batch; a host store so disconnects can be checked there too.
    config = ServeConfig(app_name="tftest", api_key=API_KEY, max_body_bytes=64 * 1024, images=False, num_cpus=1,
                         engine=serve_engine(policy="fcfs", max_num_seqs=256, max_num_batched_tokens=1024,
                                             num_device_blocks=1024, num_host_blocks=64))
    try:  # a deploy that fails halfway is deleted too
        deploy(config)
        yield ServedApp(ray_serve, API_KEY, config)
    finally:
        undeploy(config)

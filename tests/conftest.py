"""Session-wide Ray and Serve: one Ray instance and one Serve HTTP proxy for the whole test run.

Serve's proxy options are fixed by the first `serve.start` in a Ray instance, so every suite that needs HTTP takes
`serve_url` from here instead of starting its own (ray-notes §6.6: a Serve cycle costs 10-20 s).
"""

from __future__ import annotations

import os
import socket

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # before any Ray call: token auth is on by default since 2.59
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_instance():
    """Start Ray once (4 logical CPUs: Train workers, Data actors and Serve replicas share 2 cores here)."""
    import ray

    from tokenflow_ray.serve.http.proxy_guard import PROXY_CALLBACK, PROXY_CALLBACK_ENV

    started = not ray.is_initialized()
    if started:
        os.environ.setdefault(PROXY_CALLBACK_ENV, PROXY_CALLBACK)  # Serve's proxies as `tokenflow serve` has them
        ray.init(num_cpus=4, include_dashboard=False, namespace=f"t{os.getpid()}", log_to_driver=False,
                 object_store_memory=512 << 20)
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="session")
def serve_url(ray_instance) -> str:
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


def pytest_collection_modifyitems(config, items):
    """A test that takes the Ray instance must be marked `ray`: README's test command runs the unmarked ones two at
    a time (pytest-xdist) and the marked ones alone, and two Ray instances at once on two cores spoil the streams
    their tests time."""
    unmarked = [item.nodeid for item in items
                if "ray_instance" in getattr(item, "fixturenames", ()) and item.get_closest_marker("ray") is None]
    if unmarked:
        raise pytest.UsageError(f"these take the Ray instance but are not marked `ray`: {unmarked}")

"""A local Ray + Serve session for the demo, the bench and `tokenflow serve` (one place for the env rules)."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct ports the OS has free now (all held open together, so none is handed out twice)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def set_ray_env_defaults() -> None:
    """What a Ray instance started from this process should run with (its raylet and workers inherit the
    environment of the process that starts it; a variable already set wins)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Ray starts workers at nice 15 so drivers stay responsive; here a worker is the serving engine and the driver
    # is the load generator, which must not outrank it.
    os.environ.setdefault("RAY_worker_niceness", "0")
    # Serve's proxies answer for a replica that dies under a request (direct placement: serve/proxy_guard.py).
    from tokenflow_ray.serve.proxy_guard import PROXY_CALLBACK, PROXY_CALLBACK_ENV

    os.environ.setdefault(PROXY_CALLBACK_ENV, PROXY_CALLBACK)


def init_ray(num_cpus: int | None = None) -> bool:
    """Join RAY_ADDRESS if set, else start a local instance; True if this call started Ray."""
    set_ray_env_defaults()
    import ray

    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"])
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    return True


@contextlib.contextmanager
def local_serve(num_cpus: int = 4, host: str = "127.0.0.1", port: int | None = None) -> Iterator[str]:
    """Ray + Serve on loopback for the duration; yields the base URL. Shuts down what it started."""
    from ray import serve

    started = init_ray(num_cpus)
    port = port or free_port(host)
    serve.start(http_options={"host": host, "port": port})
    try:
        yield f"http://{host}:{port}"
    finally:
        serve.shutdown()
        if started:
            import ray

            ray.shutdown()

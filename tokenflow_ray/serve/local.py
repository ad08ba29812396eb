"""A local Ray + Serve session for the demo, the bench and `tokenflow serve` (one place for the env rules)."""

from __future__ import annotations

import contextlib
import os
import socket
import time
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
    # Serve's proxies answer for a replica that dies under a request (direct placement: serve/http/proxy_guard.py).
    from tokenflow_ray.serve.http.proxy_guard import PROXY_CALLBACK, PROXY_CALLBACK_ENV

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


def shutdown_serve(timeout_s: float = 60.0) -> None:
    """Shut Serve down with its controller allowed to finish, quietly.

    `serve.shutdown()` calls the controller's `graceful_shutdown()`, which by design never returns: the controller
    kills itself once its apps and proxies are gone, so the call dies with it, and Ray prints "Task
    ServeController.graceful_shutdown failed ... killed by `ray.kill`" to the driver's terminal. Asking with
    `wait=False` returns at once; then this waits for the controller's name to go (it is gone with the actor)."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    if not ray.is_initialized():
        return
    try:
        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:  # Serve is not running
        return
    _forget_serve_client()
    try:
        ray.get(controller.graceful_shutdown.remote(wait=False), timeout=timeout_s)
    except ray.exceptions.RayActorError:  # it was already on its way out
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        except ValueError:
            return
        time.sleep(0.2)
    ray.kill(controller, no_restart=True)  # it did not finish in time: what serve.shutdown would leave behind


def _forget_serve_client() -> None:
    """Drop this driver's cached Serve client and its handles (what serve.shutdown does before the controller
    call), so a later serve.start in this process starts afresh. Serve's private module state: no public call
    does only this (ray 2.60)."""
    from ray.serve import context

    client = getattr(context, "_global_client", None)
    if client is not None:
        client.shutdown_cached_handles()
    context._set_global_client(None)


def shutdown_ray() -> None:
    import ray

    ray.shutdown()


def quiet_serve_logs() -> None:
    """Serve's driver-side INFO lines (each deploy, each app ready) are for Serve's own CLI; `tokenflow serve`
    prints its own lines. Warnings and errors still show."""
    import logging

    logging.getLogger("ray.serve").setLevel(logging.WARNING)


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
        shutdown_serve()
        if started:
            shutdown_ray()

"""`tokenflow serve`'s life from the driver: deploy, say which replicas run, stop cleanly on SIGTERM or Ctrl-C.

- Start: a replica whose constructor raises (out of memory, a kernel that will not build) fails Serve's deploy
  with a page of nested tracebacks; the replica's own exception line is what a person can act on, so that one
  line is printed (`replica_failure`) and the command exits 1.
- While serving: one line per replica start and stop, with its KV pool and the policy (`ReplicaWatcher`, from the
  stats each replica sends the app's central actor).
- Stop, on SIGTERM as on Ctrl-C: new requests get 503 and live streams end with an error event and `[DONE]`
  (`stop_app`, serve/replica/stopping.py), then Serve and Ray are shut down (serve/local.py) and the command exits 0.
"""

from __future__ import annotations

import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tokenflow_ray.serve.config import ServeConfig

POLL_S = 1.0  # how often the driver looks for replicas that started or stopped
STOP_TIMEOUT_S = 10.0  # how long live streams get to end before Serve is shut down anyway

# The last "SomeError: message" line of a traceback (Ray's RayTaskError text nests the replica's traceback).
_EXC_LINE = re.compile(r"^\s*(?:[A-Za-z_][\w.]*\.)?([A-Z]\w*(?:Error|Exception|Exit|Interrupt|Failure)):\s*(.+?)\s*$")


def deploy_status_text(app_name: str) -> str:
    """Serve's status messages of the app and its deployments: where a replica's constructor traceback ends up
    (the exception `serve.run` raises says only "Failed to update the deployments")."""
    from ray import serve

    try:
        app = serve.status().applications.get(app_name)
    except Exception:  # noqa: BLE001 - the controller is gone: there is nothing more to say
        return ""
    if app is None:
        return ""
    return "\n".join([app.message or "", *(d.message or "" for d in app.deployments.values())])


def replica_failure(exc: BaseException, status_text: str = "") -> str:
    """One line for a deploy that failed because a replica could not start: the replica's own exception (type
    and message), the last one found in Serve's status text or the exception; Serve's own message when none."""
    text = f"{exc}\n{status_text}"
    found = None
    for line in text.splitlines():
        m = _EXC_LINE.match(line)
        if m and not m.group(1).startswith(("RayTaskError", "RayActorError", "ActorDiedError")) \
                and "Deploying application" not in m.group(2):
            found = f"{m.group(1)}: {m.group(2)}"
    if found is None:
        found = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(exc).__name__)
    return f"a replica failed to start: {found}"


@dataclass(frozen=True)
class ReplicaPool:
    device_blocks: int
    host_blocks: int
    block_size: int


class ReplicaWatcher:
    """Prints a line when a replica starts serving (its first stats reach the central actor) and when it stops
    (gone from the actor's stats, or the app stopped)."""

    def __init__(self, config: ServeConfig, out: Callable[[str], None] = print) -> None:
        self.config, self.out = config, out
        self.known: dict[str, ReplicaPool] = {}

    def _stats(self) -> dict | None:
        import ray

        try:
            central = ray.get_actor(self.config.central_actor_name, namespace=self.config.central_namespace)
            return ray.get(central.stats.remote(), timeout=5.0)
        except Exception:  # not created yet, or restarting: the next poll sees it
            return None

    def poll(self) -> None:
        stats = self._stats()
        if stats is None:
            return
        for rid, s in sorted(stats.items()):
            if rid not in self.known:
                g = s.get("gauges", {})
                pool = ReplicaPool(int(g.get("device_blocks_total", 0)), int(g.get("host_blocks_total", 0)),
                                   int(g.get("block_size", 0)))
                self.known[rid] = pool
                self.out(f"replica {rid} started: {self._describe(pool)}")
        for rid in sorted(set(self.known) - set(stats)):
            self._stopped(rid, "no longer reporting")

    def _describe(self, pool: ReplicaPool) -> str:
        return (f"KV pool {pool.device_blocks} device + {pool.host_blocks} host blocks of {pool.block_size} tokens, "
                f"policy {self.config.engine.scheduler.policy}")

    def _stopped(self, rid: str, why: str) -> None:
        self.out(f"replica {rid} stopped ({why}): {self._describe(self.known.pop(rid))}")

    def all_stopped(self, why: str) -> None:
        for rid in sorted(self.known):
            self._stopped(rid, why)


def stop_app(config: ServeConfig, reason: str, timeout_s: float = STOP_TIMEOUT_S) -> int:
    """Every replica refuses new streams and ends its live ones (replica/stopping.py); returns once the app's stream table
    is empty, or after timeout_s. Returns the streams still live then (0: all ended)."""
    import ray

    try:
        central = ray.get_actor(config.central_actor_name, namespace=config.central_namespace)
    except ValueError:  # no replica ever started: nothing to stop
        return 0
    deadline = time.monotonic() + timeout_s
    ray.get(central.stop_serving.remote(reason), timeout=timeout_s)
    while True:
        live = sum(row["streams"] for row in ray.get(central.summary.remote(), timeout=timeout_s).values())
        if live == 0 or time.monotonic() >= deadline:
            return live
        time.sleep(0.1)


class StopSignal:
    """SIGTERM and SIGINT set an event the main loop waits on (installed after ray.init, whose own SIGTERM handler
    would exit mid-call with a stack dump); a second signal while stopping raises KeyboardInterrupt."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.name: str | None = None

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame) -> None:
        if self.event.is_set():
            raise KeyboardInterrupt
        self.name = signal.Signals(signum).name
        self.event.set()


def run_server(config: ServeConfig) -> int:
    """Deploy, serve until SIGTERM/SIGINT, stop cleanly. 0 after a clean stop, 1 if the app could not start."""
    from ray import serve

    from tokenflow_ray.serve.app import deploy
    from tokenflow_ray.serve.local import init_ray, quiet_serve_logs, shutdown_ray, shutdown_serve

    stop = StopSignal()
    started = init_ray()
    stop.install()
    quiet_serve_logs()
    watcher = ReplicaWatcher(config, out=lambda line: print(line, flush=True))
    try:
        serve.start(http_options={"host": config.host, "port": config.port})
        try:
            deploy(config)
        except Exception as exc:  # noqa: BLE001 - Serve wraps the replica's error in RuntimeError/RayTaskError
            reason = replica_failure(exc, deploy_status_text(config.app_name))
            print(f"tokenflow: error: {reason}", file=sys.stderr, flush=True)
            return 1
        ec = config.engine
        print(f"serving {ec.model.model!r} ({config.replicas} replica(s), policy {ec.scheduler.policy}, router "
              f"{config.router}) at http://{config.host}:{config.port}{config.route_prefix.rstrip('/')}/v1  "
              "(Ctrl-C or SIGTERM to stop)", flush=True)
        watcher.poll()
        while not stop.event.wait(POLL_S):
            watcher.poll()
        print(f"{stop.name}: stopping: new requests get 503, live streams end with an error event", flush=True)
        left = stop_app(config, reason=f"the server received {stop.name}")
        if left:
            print(f"{left} stream(s) still live after {STOP_TIMEOUT_S:.0f} s; shutting down anyway", flush=True)
    finally:
        shutdown_serve()
        watcher.all_stopped("server stopped")
        if started:
            shutdown_ray()
    print("stopped", flush=True)
    return 0

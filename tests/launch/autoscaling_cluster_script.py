"""Serve autoscaling drives the Ray autoscaler on a fake multi-node cluster (ray.cluster_utils.AutoscalingCluster).

The head holds one GPU (fake: a resource count; the replicas run on CPU), so the first LLMServer replica (num_gpus:
1) runs there. Load makes the serving-signals policy ask for a second replica, which fits no node: it stays pending
until the autoscaler launches a `gpu` worker node, where it starts and serves streams. Idleness scales Serve back to
one replica (Serve stops the replica off the head first), and the idle node is terminated. Prints one JSON line:
the timeline of nodes and replicas, and which node served which stream.

Every node runs a Serve proxy (proxy_location EveryNode), as on a real cluster, and the load reaches them the way
a real deployment's does: through a load balancer that sends requests only to proxies passing `/-/healthz`
(LoadBalancer below). The fake nodes share this host, so the worker proxy binds its own port
(RAY_SERVE_WORKER_PROXY_HTTP_PORT), as it would its own address; on one shared SO_REUSEPORT port the kernel handed
connections to a freshly started proxy that did not know the routes yet, which answers 404 ("Path
'/v1/completions' not found", 37 of them once in CI) while its /-/healthz still says 503. Each proxy prefers
replicas on its own node, so the streams that reach the new node's proxy are the ones its replica serves.

Run in its own process (tests/launch/test_autoscaling_cluster.py): it starts its own Ray head.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ray.cluster_utils import AutoscalingCluster

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.launch.ray_head import HEAD_ENV  # noqa: E402  (after the path: the script runs standalone)
from tokenflow_ray.serve.local import free_ports  # noqa: E402

BIN = Path(sys.executable).parent
APP = "tfautoscale"

# Ray's fake_multi_node/example.yaml (not shipped in the 2.60 wheel, which AutoscalingCluster reads it from): the
# fake provider launches nodes as local raylets.
FAKE_BASE = {
    "cluster_name": "fake_multinode", "max_workers": 8,
    "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                 "disable_launch_config_check": True},
    "head_node_type": "ray.head.default", "auth": {}, "upscaling_speed": 1.0, "idle_timeout_minutes": 0.1,
    "docker": {}, "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
    "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": [],
    "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False, "rsync_exclude": [],
    "rsync_filter": [],
}


class LocalAutoscalingCluster(AutoscalingCluster):
    """AutoscalingCluster for a shared machine: its start()/shutdown() run `ray stop --force`, which stops every Ray
    on the host (another test session's included); this one starts the head on its own ports, temp dir and process
    group and ends exactly what it started. The config is the same (FAKE_BASE for the missing example.yaml)."""

    def _generate_config(self, head_resources, worker_node_types, autoscaler_v2=False, **config_kwargs):
        config = copy.deepcopy(FAKE_BASE)
        config["available_node_types"] = {
            **copy.deepcopy(worker_node_types),
            "ray.head.default": {"resources": dict(head_resources), "node_config": {}, "max_workers": 0}}
        config.update(config_kwargs)
        return config

    def start(self, _system_config=None, override_env=None) -> str:
        import ray

        self.temp = tempfile.mkdtemp(prefix="tfas", dir="/tmp")  # short: Ray's socket paths are length-limited
        gcs, dash, client, agent, agent_grpc, metrics, env_agent, nm, om = free_ports(9)
        ip = ray._private.services.get_node_ip_address()
        self.gcs_address = f"{ip}:{gcs}"
        self._config["provider"]["gcs_address"] = self.gcs_address  # else the fake nodes join :6379
        config_path = Path(self.temp) / "autoscaling.json"
        config_path.write_text(json.dumps(self._config))
        head = dict(self._head_resources)
        cmd = [str(BIN / "ray"), "start", "--head", "--block", f"--autoscaling-config={config_path}",
               f"--port={gcs}", f"--dashboard-port={dash}", "--dashboard-host=127.0.0.1",
               f"--temp-dir={self.temp}", f"--ray-client-server-port={client}",
               f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
               f"--metrics-export-port={metrics}", f"--runtime-env-agent-port={env_agent}",
               f"--node-manager-port={nm}", f"--object-manager-port={om}", "--disable-usage-stats",
               f"--num-cpus={head.pop('CPU')}", f"--num-gpus={head.pop('GPU', 0)}"]
        if head:
            cmd.append(f"--resources={json.dumps(head)}")
        env = {**os.environ, "AUTOSCALER_UPDATE_INTERVAL_S": "1", "RAY_FAKE_CLUSTER": "1",
               **HEAD_ENV,
               "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", **(override_env or {})}
        env.pop("RAY_ADDRESS", None)
        self.log = open(Path(self.temp) / "head.log", "w")
        self.head = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.dashboard = f"http://127.0.0.1:{dash}"
        return self.gcs_address

    def _ours(self) -> list[int]:
        """Processes of this cluster left after the head: the fake nodes' raylets and workers (they run under
        this cluster's temp dir)."""
        pids = []
        for p in Path("/proc").iterdir():
            if p.name.isdigit() and int(p.name) != os.getpid():
                try:
                    if self.temp.encode() in (p / "cmdline").read_bytes():
                        pids.append(int(p.name))
                except OSError:
                    pass
        return pids

    def shutdown(self) -> None:
        for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.head.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.head.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        for pid in self._ours():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.log.close()


class Timeline(threading.Thread):
    def __init__(self, central, t0: float) -> None:
        super().__init__(daemon=True)
        self.central, self.t0, self.samples, self.stop = central, t0, [], threading.Event()

    def run(self) -> None:
        import ray
        from ray import serve
        from ray.util.state import list_actors

        while not self.stop.is_set():
            try:
                dep = serve.status().applications[APP].deployments["LLMServer"]
                states = {str(getattr(k, "value", k)): v for k, v in dep.replica_states.items()}
                nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
                replicas = {a.name.rsplit("#", 1)[-1]: a.node_id for a in list_actors(
                    filters=[("class_name", "=", f"ServeReplica:{APP}:LLMServer"), ("state", "=", "ALIVE")],
                    detail=True)}
                streams = {sid: v["replica_id"] for sid, v in ray.get(self.central.view.remote(), timeout=5).items()}
                self.samples.append({"t": round(time.monotonic() - self.t0, 2), "states": states, "nodes": nodes,
                                     "replica_nodes": replicas, "streams": streams})
            except Exception as exc:  # noqa: BLE001 - a lost sample is a gap in the record
                self.samples.append({"t": round(time.monotonic() - self.t0, 2), "error": repr(exc)})
            time.sleep(0.5)

    def last(self, key: str, default):
        for s in reversed(self.samples):
            if key in s:
                return s[key]
        return default


class LoadBalancer:
    """Round robin over the proxies whose /-/healthz answers 200 (Serve's proxy says 503 until it has routes and
    running replicas, or while it drains), checked every `interval_s`: what a cloud load balancer in front of
    Serve's per-node proxies does. The head's proxy is always in (Serve keeps it ready even at zero replicas)."""

    def __init__(self, urls: list[str], interval_s: float = 0.25) -> None:
        self.urls, self.interval_s = urls, interval_s
        self.healthy = urls[:1]
        self.served: dict[str, int] = {u: 0 for u in urls}  # streams sent through each proxy
        self._next = 0

    async def watch(self, http, stop: asyncio.Event) -> None:
        import httpx

        while not stop.is_set():
            healthy = []
            for url in self.urls:
                try:
                    if (await http.get(f"{url}/-/healthz", timeout=2.0)).status_code == 200:
                        healthy.append(url)
                except httpx.HTTPError:
                    pass
            self.healthy = healthy or self.urls[:1]
            await asyncio.sleep(self.interval_s)

    def pick(self) -> str:
        self._next += 1
        url = self.healthy[self._next % len(self.healthy)]
        self.served[url] += 1
        return url


async def load_until(balancer: LoadBalancer, done) -> list:
    import httpx

    from tokenflow_ray.client.stream import PacedStreamClient, StreamSpec

    results: list = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(120), limits=httpx.Limits(max_connections=64)) as http:
        clients = {url: PacedStreamClient(http, url, report_interval_s=1.0) for url in balancer.urls}
        stop = asyncio.Event()
        watcher = asyncio.create_task(balancer.watch(http, stop))

        async def worker(i: int) -> None:
            while not stop.is_set():
                spec = StreamSpec(f"Load {i}: tell me about rivers.", max_tokens=32)
                results.append(await clients[balancer.pick()].run(spec))

        workers = [asyncio.create_task(worker(i)) for i in range(12)]
        deadline = time.monotonic() + 120
        while not done() and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        stop.set()
        await asyncio.gather(*workers, watcher)
    return results


def main() -> dict:
    os.environ.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    cluster = LocalAutoscalingCluster(
        head_resources={"CPU": 2, "GPU": 1},
        worker_node_types={"gpu": {"resources": {"CPU": 1, "GPU": 1}, "node_config": {}, "min_workers": 0,
                                   "max_workers": 1}},
        idle_timeout_minutes=0.1)
    t0 = time.monotonic()
    port, worker_port = free_ports(2)
    # The worker node's proxy gets its own port (its own address on a real cluster); the env reaches it through
    # the head, whose autoscaler launches the fake node's raylet.
    # A proxy left without replicas drains for RAY_SERVE_PROXY_MIN_DRAINING_PERIOD_S (30 s by default: time for a
    # cloud load balancer's health checks to notice) before Serve stops it and the node can go idle; this test's
    # LoadBalancer checks every 0.25 s, so 2 s is as safe here and the node goes 28 s sooner.
    address = cluster.start(override_env={"RAY_SERVE_WORKER_PROXY_HTTP_PORT": str(worker_port),
                                          "RAY_SERVE_PROXY_MIN_DRAINING_PERIOD_S": "2"})
    timeline = None
    try:
        import ray
        from ray import serve

        from tokenflow_ray.serve.app import deploy
        from tokenflow_ray.serve.config import ServeConfig, serve_engine
        from tokenflow_ray.serve.control.central import CentralSettings, central_name, get_central

        deadline = time.monotonic() + 90
        while True:
            try:
                ray.init(address=address, log_to_driver=False)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)
        serve.start(proxy_location="EveryNode", http_options={"host": "127.0.0.1", "port": port})
        config = ServeConfig(
            app_name=APP, num_cpus=0.5, num_gpus=1, images=False,
            autoscaling={"min_replicas": 1, "max_replicas": 2, "upscale_delay_s": 0.5, "downscale_delay_s": 2.0,
                         "metrics_interval_s": 0.25, "look_back_period_s": 1.0, "drain_timeout_s": 30.0},
            engine=serve_engine(policy="tokenflow", device="cpu", max_num_seqs=8, num_device_blocks=256,
                                num_host_blocks=128))
        deploy(config)
        t_ready = time.monotonic() - t0
        timeline = Timeline(get_central(CentralSettings(central_name(APP), config.central_namespace)), t0)
        timeline.start()
        while not timeline.samples:
            time.sleep(0.1)
        head_node = timeline.last("nodes", [None])[0]
        t_load = time.monotonic() - t0
        balancer = LoadBalancer([f"http://127.0.0.1:{port}", f"http://127.0.0.1:{worker_port}"])
        results = asyncio.run(load_until(balancer,
                                         lambda: timeline.last("states", {}).get("RUNNING", 0) >= 2
                                         and len(timeline.last("streams", {})) > 0
                                         and any(rid in timeline.last("replica_nodes", {})
                                                 and timeline.last("replica_nodes", {})[rid] != head_node
                                                 for rid in timeline.last("streams", {}).values())))
        t_unload = time.monotonic() - t0
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:  # idleness: back to one replica and the head alone
            if (timeline.last("states", {}) == {"RUNNING": 1} and len(timeline.last("nodes", [])) == 1):
                break
            time.sleep(0.5)
        time.sleep(1.0)
        timeline.stop.set()
        timeline.join(timeout=10)
        serve.delete(APP)
        print(f"[autoscaling script] done at {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
        return {"t_ready": t_ready, "t_load": t_load, "t_unload": t_unload, "head_node": head_node,
                "streams": len(results), "complete": sum(r.complete for r in results),
                "per_proxy": {("head" if u.endswith(f":{port}") else "worker"): n
                              for u, n in balancer.served.items()},
                "errors": [r.error for r in results if r.error], "samples": timeline.samples}
    finally:
        if timeline is not None:
            timeline.stop.set()
        try:
            import ray

            ray.shutdown()
        finally:
            cluster.shutdown()
            print(f"[autoscaling script] cluster off at {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)


if __name__ == "__main__":
    print(json.dumps(main()), flush=True)

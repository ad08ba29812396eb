"""Run by test_multinode.py in its own process: a 2-raylet `ray.cluster_utils.Cluster`, the app with 2 replicas
(Serve spreads them across nodes), paced streams over HTTP; prints one JSON line: the cluster's nodes, the node of
each replica and the replica of each stream (from the central actor's view while the streams were live)."""

import asyncio
import json
import os
import sys
import time
from pathlib import Path

os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

APP = "tfnodes"
STREAMS = 8


async def _load(base_url: str, central) -> tuple[list, dict[str, str]]:
    from tokenflow_ray.client import StreamSpec, run_load

    specs = [StreamSpec(f"node test {i}", max_tokens=48, rate=12.0, start_s=0.05 * i) for i in range(STREAMS)]
    load = asyncio.create_task(run_load(base_url, specs, timeout_s=120, report_interval_s=None))
    owners: dict[str, str] = {}
    while not load.done():  # registrations are fire-and-forget: sample the live table while streams run
        view = await central.view.remote()
        owners.update({sid: entry["replica_id"] for sid, entry in view.items()})
        await asyncio.sleep(0.2)
    return (await load).results, owners


def main() -> None:
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from tokenflow_ray.cluster.http_requests import owner_of
    from tokenflow_ray.serve.app import deploy, undeploy
    from tokenflow_ray.serve.config import ServeConfig, serve_engine
    from tokenflow_ray.serve.control.central import CentralSettings, central_name, get_central
    from tokenflow_ray.serve.local import free_port

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False,
                                                            "object_store_memory": 150 << 20})
    cluster.add_node(num_cpus=2, object_store_memory=150 << 20)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, namespace="tfnodes")
    # The slack router: Serve's default one, called from a proxy, prefers replicas on the proxy's own node (here
    # the head), which is locality, not balance; ours spreads by each replica's load. A mixed fleet, as nodes with
    # different devices are: rank 1's device pool is half of rank 0's.
    config = ServeConfig(app_name=APP, replicas=2, num_cpus=1, images=False, device_blocks_by_rank=(256, 128),
                         router="slack", engine=serve_engine(policy="tokenflow", num_device_blocks=256,
                                                             num_host_blocks=512, max_num_seqs=16))
    try:
        port = free_port()
        # One proxy: both raylets share this machine's loopback, where a proxy per node would collide on the port.
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        deploy(config)
        central = get_central(CentralSettings(central_name(APP), config.central_namespace,
                                              register_grace_s=config.register_grace_s))
        results, owners = asyncio.run(_load(f"http://127.0.0.1:{port}", central))
        deadline = time.monotonic() + 20
        stats: dict = {}
        while time.monotonic() < deadline and len(stats) < 2:  # stats ride each replica's report long-poll
            stats = ray.get(central.stats.remote())
            time.sleep(0.5)
        print(json.dumps({
            "cluster_nodes": sorted(n["NodeID"] for n in ray.nodes() if n["Alive"]),
            "replica_nodes": {rid: s["node_id"] for rid, s in stats.items()},
            "replica_pools": {rid: s["gauges"]["device_blocks_total"] for rid, s in stats.items()},
            # A stream too short-lived for the sampled view still names its replica in its id (direct placement).
            "stream_replicas": {r.stream_id: owners.get(r.stream_id) or owner_of(r.stream_id or "")
                                for r in results},
            "complete": sum(r.complete for r in results), "streams": len(results),
            "errors": [r.error for r in results if r.error]}))
    finally:
        try:
            undeploy(config)
            serve.shutdown()
        finally:
            ray.shutdown()
            cluster.shutdown()


if __name__ == "__main__":
    main()

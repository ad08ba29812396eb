"""Serve autoscaling drives the Ray autoscaler (ray.cluster_utils.AutoscalingCluster, fake nodes): load (sent, as a load
balancer would, only to proxies that pass /-/healthz: a new node's proxy answers 404 until it has the routes) makes
Serve ask for a replica that fits no node, the autoscaler adds a `gpu` node, the replica starts there and serves
streams, and idleness removes the replica and then the node (autoscaling_cluster_script.py, its own Ray head)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.script_runner import run_json_script


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_a_pending_replica_brings_up_a_node_and_idleness_removes_both():
    out = run_json_script(Path(__file__).with_name("autoscaling_cluster_script.py"), timeout_s=280)
    samples = [s for s in out["samples"] if "error" not in s]
    head = out["head_node"]
    changes = [(s["t"], s["states"], len(s["nodes"])) for i, s in enumerate(samples)
               if i == 0 or (s["states"], s["nodes"]) != (samples[i - 1]["states"], samples[i - 1]["nodes"])]
    print(json.dumps({k: out[k] for k in ("t_ready", "t_load", "t_unload", "streams", "per_proxy")} | {"changes": changes}))
    assert out["errors"] == [] and out["complete"] == out["streams"] > 0  # nothing cut or failed
    first = samples[0]
    assert first["nodes"] == [head] and first["states"] == {"RUNNING": 1}
    assert set(first["replica_nodes"].values()) == {head}
    # Load: a second node appears (it was not there before the load), and a replica runs on it.
    t_node = min(s["t"] for s in samples if len(s["nodes"]) == 2)
    assert t_node >= out["t_load"]
    on_new = [s for s in samples if s["states"].get("RUNNING", 0) == 2
              and any(n != head for n in s["replica_nodes"].values())]
    assert on_new, changes
    new_node = next(n for n in on_new[0]["nodes"] if n != head)
    new_replicas = {rid for s in on_new for rid, n in s["replica_nodes"].items() if n == new_node}
    # ... and serves: a stream was live on the replica of the new node.
    assert any(rid in new_replicas for s in samples for rid in s["streams"].values())
    # Idleness: the replica goes first, then its node.
    last = samples[-1]
    assert last["nodes"] == [head] and last["states"] == {"RUNNING": 1}, changes
    assert set(last["replica_nodes"].values()) == {head}
    t_served = on_new[0]["t"]
    t_replica_gone = min(s["t"] for s in samples if s["t"] > t_served and new_node not in s["replica_nodes"].values())
    t_node_gone = min(s["t"] for s in samples if s["t"] > t_served and new_node not in s["nodes"])
    assert out["t_unload"] < t_replica_gone <= t_node_gone

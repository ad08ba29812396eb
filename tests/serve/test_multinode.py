"""`replicas: 2` on two raylets: Serve spreads the replicas across nodes and streams are served from both, each
replica with the device pool its rank was given (a mixed fleet)."""

from pathlib import Path

import pytest

from tests.script_runner import run_json_script


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_replicas_on_both_raylets_serve_streams():
    out = run_json_script(Path(__file__).with_name("multinode_script.py"))
    assert out["errors"] == [] and out["complete"] == out["streams"] == 8
    assert len(out["cluster_nodes"]) == 2
    replica_nodes = out["replica_nodes"]
    assert sorted(set(replica_nodes.values())) == out["cluster_nodes"]  # one replica on each raylet
    served_by = {replica_nodes.get(rid) for rid in out["stream_replicas"].values()}
    assert served_by == set(out["cluster_nodes"])  # and both served streams
    assert sorted(out["replica_pools"].values()) == [128, 256]  # each rank's engine holds its own device pool

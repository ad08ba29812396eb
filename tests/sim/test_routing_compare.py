"""Routers on a heterogeneous simulated cluster (`tokenflow simulate routing`): each replica its own device."""

from __future__ import annotations

import json

import pytest

from tokenflow_ray.cli import main
from tokenflow_ray.sim.routing_compare import compare_routers
from tokenflow_ray.sim.setups import gpu_replica_setup
from tokenflow_ray.sim.simulator import Simulation


def test_each_replica_runs_on_its_own_device_profile():
    fast, slow = (gpu_replica_setup(g, "llama3-8b", "tokenflow") for g in ("h200", "a6000"))
    sim = Simulation(fast, num_replicas=2, replica_setups=[fast, slow])
    assert [r.runner.cost for r in sim.replicas] == [fast.cost, slow.cost]
    assert [r.engine.config.cache.num_device_blocks for r in sim.replicas] == [
        fast.engine.cache.num_device_blocks, slow.engine.cache.num_device_blocks]
    with pytest.raises(ValueError, match="one per replica"):
        Simulation(fast, num_replicas=3, replica_setups=[fast, slow])
    other_model = gpu_replica_setup("h200", "qwen2.5-32b", "tokenflow")
    with pytest.raises(ValueError, match="same model"):
        Simulation(fast, num_replicas=2, replica_setups=[fast, other_model])


def test_slack_prices_each_replicas_speed_where_pow2_counts_streams():
    """Poisson arrivals (setup d) on an H200 beside an A6000: the slack router sends the faster replica more
    streams and the cluster's readers stall less than behind Serve's count-balancing default."""
    out = compare_routers(["h200", "a6000"], setups=("d",), routers=("slack", "pow2"), num_requests=120)
    row = out["setups"]["d"]
    slack, pow2 = row["routers"]["slack"], row["routers"]["pow2"]
    for s in (slack, pow2):
        assert sum(s["per_replica_streams"].values()) == 120 and s["num_finished"] == 120
    fast, slow = slack["per_replica_streams"]["r000"], slack["per_replica_streams"]["r001"]
    assert fast > 1.5 * slow
    assert abs(pow2["per_replica_streams"]["r000"] - pow2["per_replica_streams"]["r001"]) <= 12
    assert slack["stall_s"] < pow2["stall_s"]
    assert row["slack_vs"]["pow2"]["raw_tput"] == pytest.approx(slack["raw_tput"] / pow2["raw_tput"])


def test_routing_action_writes_json(tmp_path, capsys):
    path = tmp_path / "r.json"
    argv = ["simulate", "routing", "--replica-gpus", "h200,a6000", "--setup", "c", "--requests", "20",
            "--json", str(path), "--no-progress"]
    assert main(argv) == 0
    out = json.loads(path.read_text())
    assert out["cluster"] == ["h200", "a6000"]
    assert set(out["setups"]["c"]["routers"]) == {"slack", "pow2", "round_robin"}
    assert "pow2" in out["setups"]["c"]["slack_vs"]
    assert "cluster h200,a6000" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["simulate", "routing", "--replica-gpus", "h200,tpu"],
                                  ["simulate", "routing", "--replica-gpus", "h200"],
                                  ["simulate", "routing", "--setup", "z"],
                                  ["simulate", "--replica-gpus", "h200,h200"]])
def test_bad_routing_input_is_one_line_and_exit_2(argv, capsys):
    assert main([*argv, "--no-progress", "--requests", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tokenflow: error:") and "\n" not in err

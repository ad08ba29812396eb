"""The migration policy's decisions (pure): where a moved stream goes and when an overloaded replica is relieved."""

import pytest

from tokenflow_ray.cluster.migration_policy import MigrationSettings, Relief, choose_target, plan_relief


def _row(sum_rate, capacity, paused=0, host_free=100, device_free=50, waiting=0, waiting_rate=0.0):
    return {"sum_rate": sum_rate, "capacity_tok_s": capacity, "num_paused": paused, "host_blocks_free": host_free,
            "device_blocks_free": device_free, "device_blocks_total": 100, "num_waiting": waiting,
            "waiting_rate": waiting_rate}


def test_choose_target_takes_the_least_loaded_other_replica_deterministically():
    summary = {"a": {"sum_rate": 10.0, "streams": 3}, "b": {"sum_rate": 4.0, "streams": 9},
               "c": {"sum_rate": 4.0, "streams": 2}}
    assert choose_target(summary, "a", ["a", "b", "c"]) == "c"
    assert choose_target(summary, "c", ["a", "b", "c"]) == "b"
    assert choose_target(summary, "a", ["a"]) is None
    assert choose_target({}, "a", ["z", "b"]) == "b"  # unknown load counts as none; ties by id


def test_an_overloaded_replica_with_paused_streams_is_relieved_toward_headroom():
    stats = {"hot": _row(300.0, 200.0, paused=5), "cool": _row(50.0, 200.0), "warm": _row(150.0, 200.0)}
    reliefs = plan_relief(stats, ["hot", "cool", "warm"], MigrationSettings(target_headroom=0.9))
    assert reliefs == [Relief("hot", "cool", 100.0, 5)]  # excess 100, cool has 130 of headroom


def test_relief_is_capped_by_headroom_spreads_over_targets_and_never_overfills():
    stats = {"h1": _row(500.0, 200.0, paused=20), "h2": _row(260.0, 200.0, paused=2),
             "t1": _row(100.0, 200.0), "t2": _row(150.0, 200.0)}
    settings = MigrationSettings(target_headroom=1.0, max_moves_per_tick=8)
    reliefs = plan_relief(stats, stats, settings)
    assert reliefs[0] == Relief("h1", "t1", 100.0, 8)  # the hottest first, to the most headroom
    assert reliefs[1] == Relief("h2", "t2", 50.0, 2)  # t1 is full now; h2's excess 60 capped by t2's 50
    given: dict[str, float] = {}
    for r in reliefs:
        given[r.target] = given.get(r.target, 0.0) + r.rate
    for target, rate in given.items():
        assert stats[target]["sum_rate"] + rate <= stats[target]["capacity_tok_s"] + 1e-9


@pytest.mark.parametrize("stats", [
    {"a": _row(300.0, 200.0, paused=0), "b": _row(0.0, 200.0)},  # nothing paused: moving would cut running streams
    {"a": _row(150.0, 200.0, paused=4), "b": _row(0.0, 200.0)},  # not overloaded
    {"a": _row(300.0, 200.0, paused=4), "b": _row(190.0, 200.0)},  # no headroom anywhere
    {"a": _row(300.0, 200.0, paused=4), "b": _row(0.0, 200.0, host_free=0)},  # the target has no host room
    {"a": _row(300.0, 200.0, paused=4), "b": _row(0.0, 200.0, device_free=2)},  # nor device room
    {"a": _row(100.0, 200.0, paused=4, device_free=0), "b": _row(120.0, 200.0)},  # full, but b carries more
])
def test_no_relief_without_need_or_room(stats):
    assert plan_relief(stats, stats) == []


def test_only_replicas_with_a_port_take_streams_and_settings_are_validated():
    stats = {"a": _row(300.0, 200.0, paused=4), "b": _row(0.0, 200.0)}
    assert plan_relief(stats, ["a"]) == []
    with pytest.raises(ValueError):
        MigrationSettings(target_headroom=0.0)
    with pytest.raises(ValueError):
        MigrationSettings(max_moves_per_tick=0)


def test_a_full_device_pool_is_relieved_toward_balance_and_waiting_demand_counts():
    stats = {"a": _row(150.0, 400.0, paused=6, device_free=3), "b": _row(50.0, 400.0)}
    assert plan_relief(stats, stats) == [Relief("a", "b", 50.0, 6, "device_full")]  # half the 100 difference
    stats = {"a": _row(150.0, 200.0, waiting=10, waiting_rate=100.0), "b": _row(0.0, 200.0)}
    assert plan_relief(stats, stats) == [Relief("a", "b", 50.0, 8, "overloaded")]  # Σ 250 against Γ 200


def test_repeated_relief_converges_without_moving_back():
    """Apply each relief as the move it asks for, tick after tick: the rates even out and nothing goes back."""
    stats = {"a": _row(400.0, 500.0, paused=30, device_free=0), "b": _row(0.0, 500.0)}
    moved_back = False
    for _ in range(10):
        for r in plan_relief(stats, stats):
            moved_back |= r.source == "b"
            stats[r.source]["sum_rate"] -= r.rate
            stats[r.target]["sum_rate"] += r.rate
    assert not moved_back
    assert abs(stats["a"]["sum_rate"] - stats["b"]["sum_rate"]) < 1.0


def test_a_drain_spreads_every_stream_by_declared_rate_deterministically():
    from tokenflow_ray.cluster.migration_policy import plan_drain

    summary = {"a": {"sum_rate": 10.0, "streams": 1}, "b": {"sum_rate": 0.0, "streams": 0}}
    streams = {"s1": 5.0, "s2": 20.0, "s3": 5.0, "s4": 0.0}
    plan = plan_drain(streams, summary, ["b", "a"])
    assert plan == [("s2", "b"), ("s1", "a"), ("s3", "a"), ("s4", "b")]  # b 20, a 10+5+5=20, then fewer streams
    assert plan_drain(streams, summary, []) == []
    assert plan_drain({}, summary, ["a"]) == []
    assert sorted(s for s, _ in plan_drain(streams, {}, ["c"])) == sorted(streams)  # unknown target: empty


def test_serve_instance_details_name_the_stopping_replicas():
    from tokenflow_ray.serve.control.serve_replicas import replicas_in_state

    details = {"applications": {"app": {"deployments": {
        "LLMServer": {"replicas": [{"replica_id": "r1", "state": "RUNNING"}, {"replica_id": "r2", "state": "STOPPING"}]},
        "OpenAIIngress": {"replicas": [{"replica_id": "i1", "state": "STOPPING"}]}}}, "other": {}}}
    assert replicas_in_state(details) == {"r2", "i1"}
    assert replicas_in_state(details, "RUNNING") == {"r1"}
    assert replicas_in_state({}) == set()

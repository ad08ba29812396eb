"""`tokenflow bench routing` without Ray: the seeded burst, the config checks and the medians over rounds."""

from __future__ import annotations

import pytest

from tokenflow_ray.lab.routing_bench import RoutingBenchConfig, RoutingRun, _median_summary


def test_the_burst_is_seeded_mixed_and_within_its_window():
    cfg = RoutingBenchConfig(streams=20, max_tokens=40, rate=10.0, burst_s=1.5)
    specs = cfg.specs()
    assert specs == cfg.specs() and specs != RoutingBenchConfig(streams=20, seed=1).specs()
    assert {s.rate for s in specs} == {2.5, 17.5}  # 0.25x and 1.75x: uneven demand per stream
    assert all(20 <= s.max_tokens <= 60 and 0 <= s.start_s <= 1.5 for s in specs)
    assert len({len(s.prompt) for s in specs}) > 3  # prompt lengths vary too


def test_the_prompt_mix_is_seeded_and_leaves_the_rest_of_the_burst_alone():
    cfg = RoutingBenchConfig(streams=40, long_prompt_share=0.25, long_prompt_tokens=800)
    specs, short = cfg.specs(), RoutingBenchConfig(streams=40, long_prompt_share=0.0).specs()
    long = cfg.long_prompts()
    assert len(long) == 10 and long == cfg.long_prompts()
    assert all(400 <= n <= 1200 for n in long.values())
    for i, (a, b) in enumerate(zip(specs, short)):
        assert (a.rate, a.max_tokens, a.start_s) == (b.rate, b.max_tokens, b.start_s)  # only prompts differ
        if i in long:  # a long context of the drawn length (byte-level tokens), the short question after it
            assert len(a.prompt.encode()) == long[i] and a.prompt.endswith(b.prompt)
        else:
            assert a.prompt == b.prompt and len(a.prompt) < 130
    mix = cfg.prompt_mix()
    assert mix["long_streams"] == 10 and mix["prompt_tokens_max"] == max(long.values())
    assert mix["prompt_tokens_total"] == sum(len(s.prompt) for s in specs)
    assert RoutingBenchConfig(streams=40, long_prompt_share=0.0).prompt_mix()["long_streams"] == 0
    assert RoutingBenchConfig(streams=40, seed=3).long_prompts() != cfg.long_prompts()


def test_config_checks_and_one_app_per_router():
    for bad in ({"long_prompt_share": 1.5}, {"long_prompt_share": -0.1}, {"long_prompt_tokens": 0},
                {"long_prompt_tokens": 1400, "long_prompt_share": 0.15}):  # 1.5x 1400 + 1.5x 192 > 2048 positions
        with pytest.raises(ValueError, match="long_prompt"):
            RoutingBenchConfig(**bad)
    assert RoutingBenchConfig(long_prompt_share=0.0, long_prompt_tokens=1400).long_prompts() == {}
    for bad in ({"routers": ("nope",)}, {"routers": ()}, {"streams": 0}, {"rate": 0}, {"warm_rounds": -1},
                {"warm_rounds": 1.5}, {"warm_rounds": True}):
        with pytest.raises(ValueError):
            RoutingBenchConfig(**bad)
    cfg = RoutingBenchConfig()
    a, b = cfg.serve_config("slack"), cfg.serve_config("default")
    assert (a.router, b.router) == ("slack", "default") and a.app_name != b.app_name
    assert a.replicas == b.replicas == 2 and a.engine_config() == b.engine_config()
    assert a.device_blocks_by_rank == ()  # every replica alike unless a mixed fleet is asked for
    mixed = RoutingBenchConfig(device_blocks=(384, 128))
    for sc in (mixed.serve_config("slack"), mixed.serve_config("default")):
        assert [sc.engine_config(rank).cache.num_device_blocks for rank in (0, 1)] == [384, 128]
    with pytest.raises(ValueError, match="one pool per replica"):
        RoutingBenchConfig(device_blocks=(384,))


class _Run(RoutingRun):
    def __init__(self, rnd: int, summary: dict) -> None:
        self.round, self._summary = rnd, summary

    def summary(self) -> dict:
        return self._summary


def test_medians_over_rounds_keep_every_round():
    rounds = [_Run(i, {"effective_tput": e, "ttft_p50_s": 0.1 * i, "ttft_p99_s": 1.0, "raw_tput": 50.0,
                       "stall_s": s, "per_replica_streams": p, "complete": c, "round": i})
              for i, (e, s, p, c) in enumerate([(10, 3, [6, 4], 10), (30, 1, [5, 5], 10), (20, 2, [7], 9)])]
    out = _median_summary(rounds)
    assert (out["effective_tput"], out["stall_s"], out["ttft_p50_s"]) == (20, 2, pytest.approx(0.1))
    assert out["per_replica_streams"] == [6, 4] and out["complete"] == 9
    assert [r["round"] for r in out["rounds"]] == [0, 1, 2]


def test_warm_rounds_run_first_in_turn_and_stay_out_of_the_medians(monkeypatch):
    """The session's cold start falls on unmeasured bursts, one per router per warm round, alternating as the
    measured rounds do; the medians and `order` are the measured rounds' alone, the warm ones kept apart."""
    import contextlib

    import tokenflow_ray.lab.routing_bench as rb
    import tokenflow_ray.serve.app as app
    import tokenflow_ray.serve.control.central as central
    import tokenflow_ray.serve.local as local

    calls = []

    def run_once(url, cfg, router, rnd, central_handle):
        calls.append((router, rnd))
        cold = not any(r == router for r, _ in calls[:-1])
        return _Run(rnd, {"effective_tput": 1.0 if cold else 100.0, "ttft_p50_s": 9.0 if cold else 0.2,
                          "ttft_p99_s": 1.0, "raw_tput": 1.0, "stall_s": 0.0, "per_replica_streams": [1, 1],
                          "complete": cfg.streams, "round": rnd})

    monkeypatch.setattr(rb, "_run_once", run_once)
    monkeypatch.setattr(app, "deploy", lambda sc: None)
    monkeypatch.setattr(app, "undeploy", lambda sc: None)
    monkeypatch.setattr(central, "get_central", lambda settings: None)
    monkeypatch.setattr(local, "local_serve", lambda num_cpus: contextlib.nullcontext("http://127.0.0.1:1"))
    report, runs = rb.run_routing_bench(RoutingBenchConfig(rounds=3, warm_rounds=2))
    assert calls == [("slack", -2), ("default", -2), ("default", -1), ("slack", -1),
                     ("slack", 0), ("default", 0), ("default", 1), ("slack", 1), ("slack", 2), ("default", 2)]
    assert report["order"] == ["slack", "default", "default", "slack", "slack", "default"]
    for name in ("slack", "default"):
        r = report["routers"][name]
        assert [x["round"] for x in r["rounds"]] == [0, 1, 2] and len(runs[name]) == 3
        assert (r["effective_tput"], r["ttft_p50_s"]) == (100.0, 0.2)  # the cold burst is not in the median
        assert [w["round"] for w in r["warm_rounds"]] == [-2, -1] and r["warm_rounds"][0]["ttft_p50_s"] == 9.0
    assert report["workload"]["warm_rounds"] == 2
    paired = report["paired"]  # slack against default, round by round: the measured rounds only
    assert (paired["a"], paired["b"]) == ("slack", "default")
    assert set(paired["metrics"]) == {"effective_tput", "ttft_p99_s", "ttft_p50_s", "raw_tput"}
    assert paired["metrics"]["effective_tput"]["pairs"] == 3 and paired["metrics"]["ttft_p50_s"]["verdict"] == "tie"

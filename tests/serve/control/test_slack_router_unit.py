"""SlackRequestRouter's Serve glue without a cluster: fake replicas carrying polled stats, real PendingRequests.

What a real Serve run cannot pin down cheaply: the bookings made in choose_replicas spread a burst that Serve's
routing loop routes back to back over stale stats, fresh stats retire them, completions end them, and calls that
are not streams are never booked.
"""

from __future__ import annotations

import pickle
from collections import Counter
from dataclasses import dataclass, field

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve._private.request_router import PendingRequest

from tests.cluster.test_routing import stats
from tokenflow_ray.cluster.messages import GenerateRequest
from tokenflow_ray.engine.sampling import SamplingParams
from tokenflow_ray.serve.control.slack_router import SlackRequestRouter

pytestmark = pytest.mark.timeout(60)
DEP = DeploymentID(name="LLMServer", app_name="unit")


@dataclass
class FakeReplica:
    replica_id: ReplicaID
    routing_stats: dict = field(default_factory=dict)
    max_ongoing_requests: int = 100


def _router(**kwargs) -> SlackRequestRouter:
    router = SlackRequestRouter(deployment_id=DEP, handle_source=DeploymentHandleSource.REPLICA,
                                use_replica_queue_len_cache=True)
    router.initialize_state(**kwargs)
    return router


def _replicas(n: int, **stat_fields) -> list[FakeReplica]:
    return [FakeReplica(ReplicaID(f"r{i}", DEP), stats(**stat_fields).to_dict()) for i in range(n)]


def _pending(i: int, method: str = "generate", rate: float = 8.0) -> PendingRequest:
    req = GenerateRequest(f"cmpl-{i}", SamplingParams(max_tokens=8), prompt="x" * 40, rate=rate)
    return PendingRequest(args=[req], kwargs={}, metadata=RequestMetadata(f"req{i}", f"int{i}", call_method=method))


async def _route(router, replicas, pending) -> str:
    ranks = await router.choose_replicas(replicas, pending)
    assert all(len(rank) == 1 for rank in ranks) and len(ranks) == len(replicas)  # singleton ranks, all of them
    assert pending.routing_context.should_backoff
    return ranks[0][0].replica_id.unique_id


async def test_a_burst_routed_back_to_back_over_stale_stats_is_spread_evenly():
    router = _router()
    replicas = _replicas(2, admitted_total=3)
    picks = Counter([await _route(router, replicas, _pending(i)) for i in range(8)])
    assert picks == {"r0": 4, "r1": 4}
    # The stats catch up (each replica now counts its 4): the bookings retire, the load is the stats' alone.
    for r in replicas:
        r.routing_stats = stats(admitted_total=7, num_waiting=4, num_live=4, queued_prefill_s=0.08,
                                waiting_prompt_blocks=12, waiting_rate=32.0).to_dict()
    await _route(router, replicas, _pending(99))
    assert sum(router.ledger.load(r).count for r in ("r0", "r1")) == 1  # only the newest booking is pending
    assert router.ledger.state_of("int0") == "absorbed" and router.ledger.state_of("int99") == "pending"


async def test_completions_and_moves_update_bookings_and_only_streams_are_booked():
    router = _router()
    replicas = _replicas(2)
    first = await _route(router, replicas, _pending(0))
    assert first == "r0" and router.ledger.replica_of("int0") == "r0"
    router.on_request_routed(_pending(0), ReplicaID("r1", DEP), None)  # r1 accepted it (r0 was full)
    assert router.ledger.replica_of("int0") == "r1" and router.ledger.state_of("int0") == "pending"
    router.on_request_completed(ReplicaID("r1", DEP), "int0")  # accepted, so it will show in r1's totals
    assert router.ledger.load("r1").count == 0 and router.ledger.state_of("int0") == "pending"
    replicas[1].routing_stats = stats(admitted_total=1).to_dict()  # admitted and finished within one period
    await _route(router, replicas, _pending(1))
    assert router.ledger.replica_of("int0") is None
    # A request Serve never got accepted (rejected, cancelled) is forgotten when it completes.
    await _route(router, replicas, _pending(2))
    router.on_request_completed(ReplicaID("r0", DEP), "int2")
    assert router.ledger.replica_of("int2") is None
    for i in range(3):
        await _route(router, replicas, _pending(10 + i, method="stats"))
    assert router.ledger.replica_of("int10") is None


async def test_a_replica_whose_streams_just_ended_is_not_shunned_on_stale_stats():
    """Seen on Serve: a burst later, one replica's stats (0.9 s old) still showed its last 4 streams live, which
    sent 6 of the next 8 streams to its twin. The completions the router saw make up for the stale stats."""
    router = _router()
    replicas = _replicas(2)
    first = _pending(0)
    assert await _route(router, replicas, first) == "r0"  # first stats seen: the baselines
    router.on_request_routed(first, ReplicaID("r0", DEP), None)
    for i in range(1, 9):  # a burst, spread 4/4, each accepted
        pr = _pending(i)
        rid = await _route(router, replicas, pr)
        router.on_request_routed(pr, ReplicaID(rid, DEP), None)
    router.on_request_completed(ReplicaID("r0", DEP), "int0")
    # r0's stats now count its streams live; r1's are older and show it idle.
    replicas[0].routing_stats = stats(admitted_total=5, num_running=4, num_live=4, sum_rate=32.0).to_dict()
    await _route(router, replicas, _pending(50))
    router.on_request_completed(ReplicaID("r0", DEP), "int50")
    for i in range(1, 9):  # the burst ends; r0's stats are not refreshed before the next one
        router.on_request_completed(ReplicaID(router.ledger.replica_of(f"int{i}") or "r0", DEP), f"int{i}")
    assert router.ledger.load("r0").count == -4 and router.ledger.load("r0").rate == -32.0
    picks = Counter([await _route(router, replicas, _pending(100 + i)) for i in range(8)])
    assert picks == {"r0": 4, "r1": 4}


async def test_no_stats_yet_spreads_by_count_and_a_full_replica_goes_last():
    router = _router()
    replicas = [FakeReplica(ReplicaID(f"r{i}", DEP)) for i in range(3)]
    picks = Counter([await _route(router, replicas, _pending(i)) for i in range(6)])
    assert picks == {"r0": 2, "r1": 2, "r2": 2}
    router.replica_queue_len_cache.update(ReplicaID("r0", DEP), 100)  # at max_ongoing_requests: Serve skips it
    for rid in ("int0", "int1", "int2", "int3", "int4", "int5"):  # never accepted: forgotten
        router.on_request_completed(ReplicaID("r0", DEP), rid)
    ranks = await router.choose_replicas(replicas, _pending(50))
    assert [r[0].replica_id.unique_id for r in ranks] == ["r1", "r2", "r0"]


async def test_the_declared_rate_default_rate_knob_and_malformed_stats():
    """An HTTP stream without X-Consumption-Rate is routed at the server's default_rate (the edge resolves it); a
    handle call carries the rate the ingress resolved."""
    router = _router(default_rate=12.5, bytes_per_token=4.0)
    undeclared = _http_pending(0, 128 + 40, rate=None)
    assert router._new_stream(undeclared, router._http_request(undeclared)).rate == 12.5
    new = router._new_stream(_pending(0, rate=0.0))
    assert (new.rate, new.prompt_tokens) == (0.0, 10)
    assert router._new_stream(_pending(0, rate=3.0)).rate == 3.0
    assert router._new_stream(_pending(0, method="stats")) is None
    bad = FakeReplica(ReplicaID("bad", DEP), {"num_running": 1})  # another version's stats: ignored, not misread
    good = FakeReplica(ReplicaID("good", DEP), stats(num_live=5, num_running=5).to_dict())
    # The replica without usable stats counts as one without stats: the count fallback ranks it first.
    assert await _route(router, [good, bad], _pending(1)) == "bad"


def test_the_router_switch_is_validated_and_wired_into_the_deployment():
    from tokenflow_ray.cli import build_parser
    from tokenflow_ray.serve.app import SLACK_ROUTER_PATH, build_app, request_router_config
    from tokenflow_ray.serve.config import ServeConfig

    with pytest.raises(ValueError, match="router"):
        ServeConfig(router="random", images=False)
    with pytest.raises(ValueError, match="routing_stats_period_s"):
        ServeConfig(routing_stats_period_s=0, images=False)
    slack = request_router_config(ServeConfig(router="slack", default_rate=6.0, routing_stats_period_s=0.25,
                                              images=False))
    assert slack.request_router_class == SLACK_ROUTER_PATH and slack.request_routing_stats_period_s == 0.25
    assert slack.request_router_kwargs["default_rate"] == 6.0 and slack.request_router_kwargs["bytes_per_token"] == 1
    default = request_router_config(ServeConfig(images=False))
    assert "PowerOfTwoChoices" in default.request_router_class and default.request_routing_stats_period_s == 0.5
    # The replica refreshes its cached stats at the period Serve polls them.
    for http in ("direct", "ingress"):
        app = build_app(ServeConfig(router="slack", routing_stats_period_s=0.25, images=False, http=http))
        llm = app._bound_deployment  # direct: the replicas answer HTTP
        if http == "ingress":
            llm = llm.init_args[0]._bound_deployment  # the ingress is bound to the LLMServer app
        assert llm.name == "LLMServer"
        assert llm._deployment_config.request_router_config.request_router_class == SLACK_ROUTER_PATH
        assert llm.init_args[1].routing_stats_interval_s == 0.25
    parser = build_parser()
    assert parser.parse_args(["serve", "--router", "slack"]).router == "slack"
    assert parser.parse_args(["serve"]).router is None  # the config's (default "default")
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--router", "nope"])
    bench = parser.parse_args(["bench", "routing", "--streams", "8", "--rounds", "3", "--json", "x.json"])
    assert (bench.streams, bench.rounds, bench.warm_rounds, bench.routers) == (8, 3, 1, ("slack", "default"))


@dataclass
class _ProxyRequest:  # the shape the router reads of the proxy's pickled StreamingHTTPRequest
    asgi_scope: dict


def _http_pending(i: int, body_bytes: int, rate: str | None = "8.0") -> PendingRequest:
    from ray.serve._private.common import RequestProtocol

    headers = [(b"content-type", b"application/json"), (b"content-length", str(body_bytes).encode())]
    if rate is not None:
        headers.append((b"x-consumption-rate", rate.encode()))
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}
    meta = RequestMetadata(f"req{i}", f"int{i}", _request_protocol=RequestProtocol.HTTP)
    return PendingRequest(args=[pickle.dumps(_ProxyRequest(scope))], kwargs={}, metadata=meta)


async def test_http_streams_through_the_proxy_are_read_from_headers_and_a_burst_alternates():
    """The direct placement: the proxy's router sees headers only. The prompt estimate leaves out the JSON
    around the prompt, and a burst of 8 arriving at once lands 4/4 on replicas whose stats (and learned costs)
    differ, as in test_routing.py's burst through the proxy."""
    router = _router()
    new = router._new_stream(_http_pending(0, 128 + 40), router._http_request(_http_pending(0, 128 + 40)))
    assert (new.rate, new.prompt_tokens) == (8.0, 40)
    replicas = [FakeReplica(ReplicaID("r0", DEP), stats(prefill_fixed_s=0.02, prefill_s_per_token=0.0005,
                                                        capacity_tok_s=675.0).to_dict()),
                FakeReplica(ReplicaID("r1", DEP), stats(prefill_fixed_s=0.005, prefill_s_per_token=0.0002,
                                                        capacity_tok_s=1738.0).to_dict())]
    picks = Counter([await _route(router, replicas, _http_pending(i, 230)) for i in range(8)])
    assert picks == {"r0": 4, "r1": 4}
    assert len(router.ledger) == 8

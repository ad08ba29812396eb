"""SlackRequestRouter: Serve's RequestRouter for LLMServer, routing new streams by buffer slack.

The decision is tokenflow_ray.cluster.routing's (pure, unit-tested); this adapter feeds it the replicas' polled
`routing_stats` (ReplicaStats dicts from LLMServer.record_routing_stats) and this router's own in-flight bookings.

Serve 2.60 facts this leans on (cluster-notes §2.1, read in ray/serve/_private/request_router and router.py):
- Ranks are tried in order, and within a rank Serve takes the lowest cached queue length, so singleton ranks
  `[[best], [second], ...]` impose our order. A replica whose cached queue length is at max_ongoing_requests is
  moved last: Serve would skip it anyway, and a booking on it would be wrong.
- One routing task routes several queued requests back to back without yielding, and `on_request_routed` fires
  only after the replica's accept round trip, so a burst would herd if bookings waited for it: the booking is made
  here, when the ranks are returned (the base router fulfils exactly that request with the first usable rank).
  `on_request_routed` (the replica accepted it) confirms it, on whichever replica Serve used;
  `on_request_completed` turns it into a departure the stats have yet to show (inflight.py).
- Every method call through the handle is routed here, not just streams: only `generate` calls are booked.
- In the direct placement the proxy routes HTTP requests here too, each as a pickled StreamingHTTPRequest
  carrying the ASGI scope (no body): new streams are read from path and headers, and a consumption report goes
  first to the replica its stream id names (cluster/http_requests.py).
"""

from __future__ import annotations

import logging
import pickle
import time
from typing import Any

from ray.serve._private.common import ReplicaID
from ray.serve._private.request_router import PendingRequest, RequestRouter, RunningReplica

from tokenflow_ray.cluster.http_requests import HttpRequestInfo, classify
from tokenflow_ray.cluster.inflight import InflightLedger
from tokenflow_ray.cluster.replica_stats import ReplicaStats
from tokenflow_ray.cluster.routing import (
    NewStream,
    SlackRouterConfig,
    http_prompt_tokens,
    prompt_tokens_estimate,
    rank_replicas,
)

log = logging.getLogger(__name__)

STREAM_METHOD = "generate"


class SlackRequestRouter(RequestRouter):
    def initialize_state(self, **kwargs: Any) -> None:
        self.slack = SlackRouterConfig(**kwargs)
        self.ledger = InflightLedger(self.slack.inflight_ttl_s)
        self._bad_stats: set[str] = set()  # replicas whose stats failed to parse (logged once)

    # ---- stats --------------------------------------------------------------------------------------------------
    def _stats(self, replica: RunningReplica) -> ReplicaStats | None:
        raw = replica.routing_stats
        if not raw:
            return None
        rid = replica.replica_id.unique_id
        try:
            stats = ReplicaStats.from_dict(dict(raw))
        except (TypeError, ValueError) as exc:
            if rid not in self._bad_stats:
                self._bad_stats.add(rid)
                log.warning("ignoring routing stats of %s: %s", rid, exc)
            return None
        self.ledger.observe(rid, stats.admitted_total, stats.finished_total)
        return stats

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id.unique_id for r in replicas}
        for r in replicas:
            self._stats(r)  # reconcile bookings as soon as fresh stats are broadcast
        for rid in self.ledger.replica_ids() - live:
            self.ledger.drop_replica(rid)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.ledger.drop_replica(replica_id.unique_id)

    # ---- the decision -------------------------------------------------------------------------------------------
    def _http_request(self, pending: PendingRequest) -> HttpRequestInfo | None:
        if not getattr(pending.metadata, "is_http_request", False) or not pending.args \
                or not isinstance(pending.args[0], bytes):
            return None
        try:
            scope = pickle.loads(pending.args[0]).asgi_scope  # the proxy's StreamingHTTPRequest
            return classify(scope.get("method", ""), scope.get("path", ""), scope.get("headers", ()))
        except Exception:  # not the proxy's request after all: route it like any other call
            return None

    def _new_stream(self, pending: PendingRequest | None,
                    http: HttpRequestInfo | None = None) -> NewStream | None:
        if pending is None:
            return None
        if http is not None:
            if not http.new_stream:
                return None
            # The body's consumption_rate is not here yet: the header's, else the server's default (the edge).
            rate = self.slack.default_rate if http.rate is None else http.rate
            return NewStream(rate, http_prompt_tokens(http.body_bytes, self.slack))
        if pending.metadata.call_method != STREAM_METHOD or not pending.args:
            return None
        req = pending.args[0]  # a GenerateRequest: its rate was resolved where it came in (the ingress)
        tokens = prompt_tokens_estimate(getattr(req, "prompt", None), getattr(req, "messages", None), self.slack)
        return NewStream(float(req.rate), tokens)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        now = time.time()
        self.ledger.expire(now)
        http = None if pending_request is None else self._http_request(pending_request)
        stream = self._new_stream(pending_request, http)
        new = stream or NewStream(self.slack.default_rate, 1)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        stats = {rid: self._stats(r) for rid, r in by_id.items()}
        order = rank_replicas(stats, {rid: self.ledger.load(rid) for rid in by_id}, new, self.slack, now)
        full = {rid for rid, r in by_id.items()
                if (q := self.replica_queue_len_cache.get(r.replica_id)) is not None and q >= r.max_ongoing_requests}
        order = [rid for rid in order if rid not in full] + [rid for rid in order if rid in full]
        if http is not None and http.owner in by_id:  # a report: its stream's replica applies it at once
            order = [http.owner] + [rid for rid in order if rid != http.owner]
        if pending_request is not None:
            if stream is not None:
                self.ledger.book(pending_request.metadata.internal_request_id, order[0], now, new.rate,
                                 new.prompt_tokens)
            # Every candidate is in the ranks: if none takes the request, back off before asking again rather
            # than spin (Serve re-calls choose_replicas at once otherwise).
            pending_request.routing_context.should_backoff = True
        return [[by_id[rid]] for rid in order]

    # ---- lifecycle hooks ----------------------------------------------------------------------------------------
    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self.ledger.accepted(pending_request.metadata.internal_request_id, replica_id.unique_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.ledger.complete(internal_request_id, time.time())

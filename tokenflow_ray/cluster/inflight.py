"""InflightLedger: what a router knows about each replica's load that the replica's last stats do not show yet.

Replica stats arrive by poll (every `request_routing_stats_period_s`, then the controller's broadcast: ~0.5-1.5 s
old when read), so a burst routed on stats alone all lands on whichever replica looked best at the last poll
(ray-notes §6.2), and a replica whose streams just ended still looks busy. The router books each stream here when it
picks a replica; the ledger tracks it through three states per replica:

    pending  - routed, not yet in the replica's `admitted_total`: adds to the stats' load
    absorbed - counted by the stats (the replica admitted it): adds nothing
    departed - completed, while the stats may still count it live: subtracts from the stats' load

Reconciliation is by count, not by clock. Each snapshot carries the replica's `admitted_total` and
`finished_total` (streams ever added to / retired from its engine); when the first grows by Δ, the Δ oldest pending
bookings are absorbed; when the second grows by Δ, the Δ oldest departed ones are forgotten, and what is left of Δ
(the engine retires a stream before its response ends, so a snapshot often shows a finish before the router hears
of it) retires the next completions at once, up to the count of absorbed streams. Kept only as departures, those
finishes would have counted twice, and for ttl_s a replica read up to 8 streams lighter than it was: through
most of a traced burst of `tokenflow bench routing`, which sent it the early streams. A request that
completes while pending was rejected or never sent, unless the replica accepted it (`accepted`, Serve's
on_request_routed): then it is marked done and, once absorbed, departs at once. With one router per replica set
(one ingress replica) this is exact. With several, the others' arrivals and departures retire ours early, so the
ledger errs towards the stats alone, never stuck high. Pending and departed entries also lapse after `ttl_s`.

Pure Python; one instance per router, used from the router's event loop only.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Booking:
    request_id: str
    replica_id: str
    booked_at: float
    rate: float  # declared tokens/s
    prompt_tokens: int
    accepted: bool = False  # the replica accepted the request (it may be admitted even if it completes early)
    done: bool = False  # completed while pending: counts for nothing, but will show in both totals
    departed_at: float | None = None


@dataclass(frozen=True)
class InflightLoad:
    """What a replica's bookings change about its last stats (count and rate are net: departures subtract)."""

    count: int = 0
    rate: float = 0.0
    # Pending streams as (booked_at, prompt_tokens), oldest first: their prompts still need blocks, and their
    # prefills queue behind what the stats showed waiting from when they were booked.
    pending: tuple[tuple[float, int], ...] = ()
    last_booked_at: float = float("-inf")  # the replica's latest booking (a tie-break)
    departed: int = 0  # streams the last stats count live that have ended since (the departures in count)

    @property
    def prompt_tokens(self) -> tuple[int, ...]:
        return tuple(n for _, n in self.pending)


@dataclass
class _Replica:
    pending: OrderedDict[str, Booking]
    absorbed: dict[str, Booking]
    departed: OrderedDict[str, Booking]
    admitted: int | None = None  # totals in the last snapshot seen
    finished: int | None = None
    # Finishes the stats counted before this router heard of them (on_request_completed): the engine retires a
    # stream before its response ends, so a snapshot often shows it gone first. The next completions are theirs.
    finished_unheard: int = 0
    last_booked_at: float = float("-inf")


class InflightLedger:
    def __init__(self, ttl_s: float = 5.0) -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s: must be > 0, got {ttl_s!r}")
        self.ttl_s = ttl_s
        self._replicas: dict[str, _Replica] = {}
        self._where: dict[str, str] = {}  # request id -> replica id, for every state

    def _replica(self, replica_id: str) -> _Replica:
        return self._replicas.setdefault(replica_id, _Replica(OrderedDict(), {}, OrderedDict()))

    def _pop(self, request_id: str) -> Booking | None:
        replica_id = self._where.pop(request_id, None)
        if replica_id is None:
            return None
        r = self._replicas[replica_id]
        for table in (r.pending, r.absorbed, r.departed):
            if request_id in table:
                return table.pop(request_id)
        return None

    # ---- router events ----------------------------------------------------------------------------------------
    def book(self, request_id: str, replica_id: str, now: float, rate: float, prompt_tokens: int) -> None:
        """Book (or re-book, if routing picks again for the same request) a stream on a replica."""
        self._pop(request_id)
        r = self._replica(replica_id)
        r.pending[request_id] = Booking(request_id, replica_id, now, rate, prompt_tokens)
        r.last_booked_at = now
        self._where[request_id] = replica_id

    def accepted(self, request_id: str, replica_id: str) -> None:
        """The replica accepted the request (it may be elsewhere than booked: the first choice was full)."""
        old = self._where.get(request_id)
        if old is None or request_id not in self._replicas[old].pending:
            return
        b = self._pop(request_id)
        self._replica(replica_id).pending[request_id] = replace(b, replica_id=replica_id, accepted=True)
        self._where[request_id] = replica_id

    def complete(self, request_id: str, now: float) -> None:
        replica_id = self._where.get(request_id)
        if replica_id is None:
            return
        r = self._replicas[replica_id]
        if request_id in r.pending:
            b = r.pending[request_id]
            if b.accepted:
                r.pending[request_id] = replace(b, done=True, departed_at=now)
            else:
                self._pop(request_id)  # rejected or never sent: the replica never counts it
        elif request_id in r.absorbed:
            b = r.absorbed.pop(request_id)
            if r.finished_unheard > 0:  # the stats already count it finished
                r.finished_unheard -= 1
                del self._where[request_id]
            else:
                r.departed[request_id] = replace(b, departed_at=now)

    # ---- replica stats ----------------------------------------------------------------------------------------
    def observe(self, replica_id: str, admitted_total: int, finished_total: int) -> None:
        """A stats snapshot of `replica_id`: what it now counts of our arrivals and departures."""
        r = self._replica(replica_id)
        if r.admitted is None or r.finished is None:
            # First snapshot: no baseline, so which bookings it includes is unknown; keep them (an over-count for
            # at most ttl_s steers new streams elsewhere, which is the safe side).
            r.admitted, r.finished = admitted_total, finished_total
            return
        for _ in range(min(max(0, admitted_total - r.admitted), len(r.pending))):
            rid, b = r.pending.popitem(last=False)
            (r.departed if b.done else r.absorbed)[rid] = b
        unheard = r.finished_unheard + max(0, finished_total - r.finished)
        while unheard and r.departed:
            rid, _b = r.departed.popitem(last=False)
            del self._where[rid]
            unheard -= 1
        # Finishes beyond the streams of ours still live there are not ours (another router's, or unbooked).
        r.finished_unheard = min(unheard, len(r.absorbed))
        # An older snapshot delivered late leaves the baselines where they are.
        r.admitted, r.finished = max(r.admitted, admitted_total), max(r.finished, finished_total)

    def expire(self, now: float) -> None:
        for r in self._replicas.values():
            for table, key in ((r.pending, "booked_at"), (r.departed, "departed_at")):
                while table:
                    rid, b = next(iter(table.items()))
                    if now - getattr(b, key) < self.ttl_s:
                        break
                    table.popitem(last=False)
                    del self._where[rid]

    def drop_replica(self, replica_id: str) -> None:
        r = self._replicas.pop(replica_id, None)
        if r is not None:
            for rid in (*r.pending, *r.absorbed, *r.departed):
                del self._where[rid]

    # ---- reads ------------------------------------------------------------------------------------------------
    def load(self, replica_id: str) -> InflightLoad:
        r = self._replicas.get(replica_id)
        if r is None:
            return InflightLoad()
        live = [b for b in r.pending.values() if not b.done]
        gone = list(r.departed.values())
        return InflightLoad(len(live) - len(gone), sum(b.rate for b in live) - sum(b.rate for b in gone),
                            tuple((b.booked_at, b.prompt_tokens) for b in live), r.last_booked_at, len(gone))

    def replica_ids(self) -> set[str]:
        return set(self._replicas)

    def replica_of(self, request_id: str) -> str | None:
        return self._where.get(request_id)

    def state_of(self, request_id: str) -> str | None:
        """'pending', 'absorbed' or 'departed' (None: not tracked)."""
        replica_id = self._where.get(request_id)
        if replica_id is None:
            return None
        r = self._replicas[replica_id]
        return "pending" if request_id in r.pending else "absorbed" if request_id in r.absorbed else "departed"

    def __len__(self) -> int:
        return len(self._where)

"""The buffer-slack routing decision: which replica can start a new stream soonest without starving its readers.

Every replica is priced in seconds, so the terms add up and heterogeneous replicas compare fairly:

    score = ttft + slack_stall + overload + memory + utilisation
    ttft        = the step in progress at the replica's running batch + what is left of the prefill queued there
                  at its last stats (drained by the time since: stats are 0.3-1.5 s old when read) + what is left
                  of the prompts of streams this router booked there that are still starting (each reaches the
                  replica `starting_s` after booking and is prefilled behind the one before: `booked_queue`), at
                  the cheapest replica's per-token cost + this stream's own prefill (the replica's cost model)
    slack_stall = max(0, ttft − min_buffer_s): that prefill work delays the replica's decodes; its least-buffered
                  running reader stalls for whatever the buffer does not cover (what "without pushing a stream
                  below its buffer slack" costs when it cannot be avoided)
    overload    = overload_horizon_s × the share of this stream's rate r that goes unserved there: the rise in
                  the replica's shortfall (D + r − Γ)⁺ − (D − Γ)⁺ over r, where D = Σ rate (working set + waiting
                  in the stats, plus booked, less departed since them (inflight.py)) and Γ the decode capacity.
                  0 while it fits, 1 on a replica already over Γ (see `unserved_share`). Off by default (see
                  `SlackRouterConfig.overload_horizon_s`): demand still counts through the utilisation term and,
                  between tied scores, after the counts
    memory      = memory_penalty_s when the free device blocks, less what waiting and booked streams need, do not
                  hold this stream's prompt: someone must be paused (or the stream waits) before it starts
    utilisation = utilisation_weight_s × min(1, D/Γ): between replicas that can all start it at once, the one with
                  more headroom (Γ − D) left takes it, so later, faster readers still fit somewhere

The booked prompts are priced at one rate on every replica so that a burst's own streams raise the price of
where they went: with them only counted between tied scores, two equal replicas whose scores stand more than the
tolerance apart (twins' learned costs drifted apart on a shared box, or a snapshot from the last burst's start)
take a whole burst on one, as a CI run's 8/0 did, since nothing in the score grew with the bookings. At each
replica's own rate, that rate's noise would be multiplied by the count. Departures count too: once the ledger has
seen every stream a snapshot shows live end, its queue, its readers' least buffer and its waiting prompts' blocks
are gone.

Scores within `ttft_tolerance_s` of the best remaining one count as equal: each replica's cost model is learned
from its own noisy steps (a shared CPU, a GPU's clocks), and letting a few milliseconds of estimate decide would
send every stream to whichever replica happens to look fastest while both can start it at once. Equal replicas go
first to the one with fewer streams ahead of this one: those its stats showed waiting and not yet started by now,
and those this router booked there that are still starting (in the proxy, the replica's HTTP handler or their
prefill: `booked_queue`). That count is no estimate, and the router's own bookings are the one load signal as
fresh for every replica: priced from each replica's stats instead, a burst herded onto whichever replica's stats
had just been refreshed (its bookings absorbed, the other's still modelled with an idle replica's prior costs: 7
in a row there), and its first tokens queued. Then fewer live streams (the stats' count, with bookings and
departures since): each holds blocks that grow and shares every step and the replica's CPU, and balancing demand
first left 35/29 splits whose fuller replica had the slowest first tokens (`tokenflow bench routing`: P99 TTFT
0.25 against default's 0.21 s; fewer streams first, 0.18 against 0.24). Then the lower demand D (booked streams
and this one included), then the larger free share of the device pool, then the one this router sent a stream to least
recently (idle replicas take turns rather than all light load landing on one), then the smaller replica id:
deterministic. Counts and demand, not headroom Γ − D nor D/Γ: Γ is an estimate too, and two identical replicas'
estimates were seen 2.5x apart (675 vs 1738 tok/s, one of them stale), which would hand one replica 6 of 8
identical streams; capacity differences still count through the score's utilisation term (and, where it is
turned on, the overload term).

A replica whose cost model has learned from fewer than `min_prefill_samples` steps with prefill (0: started, or
never sent a stream) is priced as the better of its own costs and the cheapest measured replica's, cost by cost
(optimism under uncertainty). Priced by its prior alone it never got a stream to learn from: the prior is a guess for
any device (5e-4 s a prompt token; an H200's learned cost is 30x less), so in a simulated cluster of two H200s and
two A6000s under Poisson arrivals one A6000 took 1 of 300 streams while its twin took 40 (`tokenflow simulate
routing`). Priced by its first few steps alone, the same: two idle twins whose first prompts were measured 10x apart
(one ran beside the other's start-up) sent 8 streams 50 ms apart all to one, and at low load nothing corrects the
slow-looking one's estimate, as it gets no prompt to learn from.

Replicas without stats yet (just started) make the score incomparable, so while any candidate lacks stats all are
ranked by stream count (live + booked), then least recently chosen, then id: an even spread, the in-flight
bookings keep a burst from herding.

Pure Python (no ray): `SlackRequestRouter` (serve/control/slack_router.py) is the thin Serve adapter.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from tokenflow_ray.cluster.inflight import InflightLoad
from tokenflow_ray.cluster.replica_stats import ReplicaStats


@dataclass(frozen=True)
class SlackRouterConfig:
    # Seconds of starvation a newcomer's unserved share is priced over; 0 (the default): the term is off. At 10 it
    # changed no decision of the simulator's (4x H200, 2x H200 + 2x A6000, setups a and d: identical runs with 0),
    # and on the real box it cost first tokens: near Γ its 0-or-1 flips with the ±20% noise of two twins' Γ
    # estimates and outweighs any TTFT difference (`tokenflow bench routing`, 20 paired rounds: P99 TTFT 1.17x and
    # 1.27x the default's with it, ties without). Set it where Γ is estimated reliably and replicas differ.
    overload_horizon_s: float = 0.0
    memory_penalty_s: float = 1.0  # price of a replica that must pause someone (or wait) to fit the prompt
    utilisation_weight_s: float = 0.1  # price of a fully used Γ, between otherwise equal replicas
    ttft_tolerance_s: float = 0.05  # scores this close are equal; streams ahead, live streams, demand decide
    # A replica's costs count as its own once its cost model has learned from this many steps with prefill; before
    # that they are the prior's or a few noisy first steps' (a first prompt priced a prefill token at 7x its cost in
    # a long chunk), and it is priced as the better of them and the cheapest measured replica's. 0: every replica's
    # costs as it reports them, its prior's included.
    min_prefill_samples: int = 8
    # A booked stream reaches its replica this long after booking (the proxy, the replica's HTTP handler), then
    # its prefill queues behind the bookings before it (`booked_queue`): until that ends it is still starting, ahead
    # of a newcomer there. About the first-token latency of an idle replica over HTTP here (0.04-0.07 s); the
    # router's own bookings are the one load signal fresh for every replica alike.
    starting_s: float = 0.1
    inflight_ttl_s: float = 5.0  # a booking the stats never confirm is dropped after this long
    default_rate: float = 0.0  # rate of a request that declares none (the server's default_rate)
    bytes_per_token: float = 1.0  # text prompt length estimate (the embedded model's tokenizer is byte-level)
    # An HTTP request is routed on its headers (the body comes later): its prompt is estimated from Content-Length
    # less the JSON around the prompt, which is most of a short request's body (our paced client's fields: 193
    # bytes; the openai client's minimum: 62). Counted as prompt, it tripled the estimate of 40-120 byte prompts,
    # and with it each booked stream's prefill and blocks.
    http_envelope_bytes: int = 128

    def __post_init__(self) -> None:
        for name in ("overload_horizon_s", "memory_penalty_s", "utilisation_weight_s", "ttft_tolerance_s",
                     "default_rate", "starting_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name}: must be a finite number >= 0, got {v!r}")
        for name in ("http_envelope_bytes", "min_prefill_samples"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name}: must be an int >= 0, got {v!r}")
        for name in ("inflight_ttl_s", "bytes_per_token"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name}: must be a finite number > 0, got {v!r}")


@dataclass(frozen=True)
class NewStream:
    rate: float  # declared tokens/s (0: unpaced)
    prompt_tokens: int


@dataclass(frozen=True)
class ReplicaScore:
    replica_id: str
    score_s: float
    ttft_s: float
    ahead: int  # streams still to start before this one: waiting at the stats and not started since, and booked
    streams: int  # live there: the stats' count with this router's bookings and departures since
    demand_tok_s: float  # D: Σ declared rate there, with the booked streams and this one
    headroom_tok_s: float  # Γ − D
    utilisation: float  # D / Γ
    free_blocks: int  # free device blocks less what waiting and booked streams claim
    free_share: float  # free_blocks / the device pool
    last_booked_at: float  # this router's latest booking there


def prefill_queue(stats: ReplicaStats, now: float) -> tuple[float, int]:
    """(seconds until the prefills the snapshot showed waiting are done, how many are still to start) at `now`.

    The replica works its queue from `computed_at`, and stats are 0.3-1.5 s old when read (ray-notes §6.2), so
    time since drains it: a stale snapshot's queue has mostly started by now.
    """
    start = stats.computed_at
    left = stats.queued_prefill_s - max(0.0, now - start)  # a replica clock ahead of ours: nothing drained yet
    if left <= 0:
        return 0.0, 0
    return left, math.ceil(stats.num_waiting * left / stats.queued_prefill_s - 1e-9)  # pro rata, less a hair


def score_replica(replica_id: str, stats: ReplicaStats, inflight: InflightLoad, new: NewStream,
                  cfg: SlackRouterConfig, now: float | None = None,
                  booked_s_per_token: float | None = None) -> ReplicaScore:
    """`now`: wall time (time.time()) of the decision; None: the snapshot's own, every booking still starting.
    `booked_s_per_token`: the price of a prompt token booked here and still starting (None: the replica's own)."""
    # Every stream the stats showed live has ended since (departures the ledger saw): their queue and the least
    # buffer among their readers are gone with them. Stats are 0.3-1.5 s old, about a short burst's life, and a
    # snapshot from the last burst's start would price a reader that has long left as about to stall.
    ended = stats.num_live > 0 and inflight.departed >= stats.num_live
    wait, ahead = (0.0, 0) if ended else prefill_queue(stats, stats.computed_at if now is None else now)
    per_token = stats.prefill_s_per_token if booked_s_per_token is None else booked_s_per_token
    booked_wait, starting = booked_queue(inflight.pending, per_token, cfg.starting_s, now)
    ahead += starting
    wait += booked_wait  # their prompts are prefilled with or before this one's (chunked together)
    ttft = stats.decode_step_s + wait + stats.prefill_s(new.prompt_tokens)
    stall = 0.0 if stats.min_buffer_s is None or ended else max(0.0, ttft - stats.min_buffer_s)
    before = max(0.0, stats.demand_rate + inflight.rate)  # departures can undercut stale stats
    demand = before + new.rate
    capacity = stats.capacity_tok_s
    overload = cfg.overload_horizon_s * unserved_share(before, new.rate, capacity)
    free = (stats.device_blocks_free - (0 if ended else stats.waiting_prompt_blocks)
            - sum(stats.blocks_for(n) for n in inflight.prompt_tokens))
    memory = cfg.memory_penalty_s if free < stats.blocks_for(new.prompt_tokens) else 0.0
    used = demand / capacity  # ReplicaStats guarantees Γ > 0
    utilisation = cfg.utilisation_weight_s * min(1.0, used)  # past Γ only the overload term (if on) grows
    return ReplicaScore(replica_id, ttft + stall + overload + memory + utilisation, ttft, ahead,
                        max(0, stats.num_live + inflight.count), demand, capacity - demand, used, free,
                        free / max(1, stats.device_blocks_total), inflight.last_booked_at)


def booked_queue(pending: tuple[tuple[float, int], ...], s_per_token: float, starting_s: float,
                 now: float | None) -> tuple[float, int]:
    """(seconds of the booked prompts' prefill left at `now`, how many of them are still starting) on one replica.

    Bookings, oldest first, queue one behind the other: each reaches the replica `starting_s` after it was booked
    (the proxy and the HTTP handler) and its prefill, `s_per_token` a token, starts when the one before it is done.
    A booking is still starting until its prefill ends; the work left counts in full until its turn comes. A short
    prompt's prefill is a millisecond or two, so it counts for about `starting_s`; a 1024-token one took 150 ms
    alone here (two 512-token chunks), and with a flat `starting_s` window it stopped counting after a tenth of a
    second while it held its replica's steps, so the next short prompts queued behind it. `now` None: no clock,
    every booking still starting with all its work (the snapshot's own view)."""
    if now is None:
        return s_per_token * sum(n for _, n in pending), len(pending)
    left, count, end = 0.0, 0, float("-inf")
    for booked_at, n in pending:
        work = s_per_token * n
        end = max(end, booked_at + starting_s) + work
        if end > now:
            count += 1
            left += min(work, end - now)
    return left, count


def unserved_share(demand: float, rate: float, capacity: float) -> float:
    """The share of a new reader's `rate` the cluster no longer serves if it joins a replica with `demand` on
    `capacity` Γ: the rise in the replica's shortfall (D − Γ)⁺, over the rate. 0 while it still fits, 1 on a replica
    already over Γ, where the policy shares the shortfall among its readers and the newcomer's rate is all shortfall
    whoever ends up reading less. So between replicas all over Γ it is the same wherever the stream goes, and the
    other terms and the tie-breaks (starts soonest, fewest streams) decide, not Γ's estimate. Priced as each
    replica's per-reader starvation (D − Γ)/D instead, it equalised D/Γ between overloaded twins: at 10 s a term,
    a few percent of Γ estimate was worth more than any count: a traced burst of `tokenflow bench routing
    --pin-cpus` split its demand 990/1065 tok/s and its streams 37/29.
    An unpaced reader (rate 0) takes its share of what is left: the replica's per-reader share (D − Γ)⁺/D."""
    if rate <= 0:
        return max(0.0, demand - capacity) / demand if demand > 0 else 0.0
    return (max(0.0, demand + rate - capacity) - max(0.0, demand - capacity)) / rate


def rank_replicas(stats: Mapping[str, ReplicaStats | None], inflight: Mapping[str, InflightLoad], new: NewStream,
                  cfg: SlackRouterConfig, now: float | None = None) -> list[str]:
    """Candidate replica ids (the keys of `stats`; None: no stats yet), best first. `now`: as in score_replica."""
    if any(s is None for s in stats.values()):
        def count(rid: str) -> int:
            s = stats[rid]
            return inflight.get(rid, InflightLoad()).count + (0 if s is None else s.num_live)

        return sorted(stats, key=lambda rid: (count(rid), inflight.get(rid, InflightLoad()).last_booked_at, rid))
    measured = [s for s in stats.values() if s.prefill_samples > 0]
    if measured and any(s.prefill_samples < cfg.min_prefill_samples for s in stats.values()):
        peer = min(measured, key=lambda s: (s.prefill_s(new.prompt_tokens), s.decode_step_s))
        stats = {rid: s if s.prefill_samples >= cfg.min_prefill_samples else priced_like(s, peer)
                 for rid, s in stats.items()}
    # Streams booked and still starting are priced at one rate everywhere, the cheapest replica's: a replica's own
    # estimate is noisy, and multiplied by the count of its bookings it would let that noise split a burst.
    price = min(s.prefill_s_per_token for s in stats.values())
    remaining = sorted((score_replica(rid, s, inflight.get(rid, InflightLoad()), new, cfg, now, price)
                        for rid, s in stats.items()),
                       key=lambda r: (r.score_s, r.replica_id))
    order: list[str] = []
    while remaining:  # the best remaining score and those within the tolerance of it form the next tier
        cut = remaining[0].score_s + cfg.ttft_tolerance_s
        tier = [r for r in remaining if r.score_s <= cut]
        remaining = remaining[len(tier):]
        tier.sort(key=lambda r: (r.ahead, r.streams, r.demand_tok_s, -r.free_share, r.last_booked_at, r.replica_id))
        order += [r.replica_id for r in tier]
    return order


def priced_like(unmeasured: ReplicaStats, peer: ReplicaStats) -> ReplicaStats:
    """`unmeasured`'s stats with each cost the better of its own (the prior's) and a measured `peer`'s; its queued
    prefill rescaled to the cheaper per-token cost. Counts, memory and demand stay its own."""
    per_token = min(unmeasured.prefill_s_per_token, peer.prefill_s_per_token)
    scale = per_token / unmeasured.prefill_s_per_token if unmeasured.prefill_s_per_token > 0 else 1.0
    return replace(unmeasured, decode_step_s=min(unmeasured.decode_step_s, peer.decode_step_s),
                   prefill_fixed_s=min(unmeasured.prefill_fixed_s, peer.prefill_fixed_s),
                   prefill_s_per_token=per_token, queued_prefill_s=unmeasured.queued_prefill_s * scale,
                   capacity_tok_s=max(unmeasured.capacity_tok_s, peer.capacity_tok_s))


def prompt_tokens_estimate(prompt: object, messages: object, cfg: SlackRouterConfig) -> int:
    """Token count of a request's prompt as the router can see it: ids are exact, text is estimated."""
    if isinstance(prompt, (tuple, list)):
        return max(1, len(prompt))
    text = prompt if isinstance(prompt, str) else ""
    if isinstance(messages, (tuple, list)):
        text = "".join(str(c) for m in messages for c in (m if isinstance(m, (tuple, list)) else (m,)))
    return max(1, math.ceil(len(text.encode()) / cfg.bytes_per_token))


def http_prompt_tokens(body_bytes: int, cfg: SlackRouterConfig) -> int:
    """Prompt token estimate of an HTTP request from its body's size alone (see `http_envelope_bytes`)."""
    return max(1, math.ceil(max(0, body_bytes - cfg.http_envelope_bytes) / cfg.bytes_per_token))

"""The buffer-slack routing decision (pure Python): what it prefers, what it avoids, how bookings spread a burst."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from tokenflow_ray.cluster.inflight import InflightLedger, InflightLoad
from tokenflow_ray.cluster.replica_stats import ReplicaStats
from tokenflow_ray.cluster.routing import (
    NewStream,
    SlackRouterConfig,
    booked_queue,
    http_prompt_tokens,
    prefill_queue,
    prompt_tokens_estimate,
    rank_replicas,
    score_replica,
    unserved_share,
)

CFG = SlackRouterConfig()
OVERLOAD_ON = SlackRouterConfig(overload_horizon_s=10.0)  # the overload term is off by default
NEW = NewStream(rate=10.0, prompt_tokens=32)


def stats(**over) -> ReplicaStats:
    """An idle replica: 256 free blocks of 16, Γ = 500 tok/s, a 20 ms prefill of 32 tokens after a 10 ms step."""
    base = dict(computed_at=100.0, block_size=16, device_blocks_total=256, device_blocks_free=256,
                host_blocks_total=1024, host_blocks_free=1024, waiting_prompt_blocks=0, sum_rate=0.0,
                waiting_rate=0.0, capacity_tok_s=500.0, min_buffer_s=None, queued_prefill_s=0.0, decode_step_s=0.01,
                prefill_fixed_s=0.01, prefill_s_per_token=0.0003125, prefill_chunk_tokens=512, prefill_samples=50,
                num_running=0, num_paused=0, num_waiting=0, num_live=0)
    base.update(over)
    # Totals consistent with the live count unless given: admitted = finished + live.
    if "admitted_total" in base:
        base.setdefault("finished_total", base["admitted_total"] - base["num_live"])
    base.setdefault("finished_total", 0)
    base.setdefault("admitted_total", base["finished_total"] + base["num_live"])
    return ReplicaStats(**base)


def rank(by_replica: dict, inflight: dict | None = None, new: NewStream = NEW, cfg: SlackRouterConfig = CFG):
    return rank_replicas(by_replica, inflight or {}, new, cfg)


def test_more_headroom_wins_between_replicas_that_can_start_at_once():
    busy = stats(sum_rate=400.0, num_running=20, num_live=20)
    light = stats(sum_rate=50.0, num_running=20, num_live=20)
    assert rank({"a": busy, "b": light}) == ["b", "a"]
    assert rank({"a": light, "b": busy}) == ["a", "b"]


def test_a_replica_whose_memory_is_full_is_avoided_even_with_a_shorter_queue():
    full = stats(device_blocks_free=1)
    queued = stats(num_waiting=2, num_live=2, queued_prefill_s=0.04, waiting_prompt_blocks=4)
    assert rank({"a": full, "b": queued}) == ["b", "a"]
    # Waiting streams' prompts and streams booked since the stats count against the free blocks too.
    claimed = stats(device_blocks_free=5, waiting_prompt_blocks=4)  # 1 block left; the prompt needs 2
    assert score_replica("a", claimed, InflightLoad(), NEW, CFG).free_blocks == 1
    assert rank({"a": claimed, "b": queued}) == ["b", "a"]
    booked = stats(device_blocks_free=6)
    assert rank({"a": booked, "b": queued}, {"a": InflightLoad(1, 0.0, ((0.0, 70),))}) == ["b", "a"]  # 5 blocks booked


def test_memory_penalty_knob():
    full = stats(device_blocks_free=1)
    queued = stats(num_waiting=4, num_live=4, queued_prefill_s=0.1, waiting_prompt_blocks=8)
    assert rank({"a": full, "b": queued}, cfg=SlackRouterConfig(memory_penalty_s=0.0)) == ["a", "b"]


def test_an_overloaded_replica_is_avoided_and_the_horizon_knob_prices_it():
    over = stats(sum_rate=480.0, waiting_rate=40.0, num_running=30, num_live=30)  # 530 tok/s of demand on Γ=500
    queued = stats(num_waiting=3, num_live=3, queued_prefill_s=0.06, waiting_prompt_blocks=6)
    assert rank({"a": over, "b": queued}, cfg=OVERLOAD_ON) == ["b", "a"]
    assert CFG.overload_horizon_s == 0.0  # off by default: the queue behind b's three waiting prompts decides
    assert rank({"a": over, "b": queued}) == ["a", "b"]
    no_horizon = SlackRouterConfig(overload_horizon_s=0.0, utilisation_weight_s=0.0)
    assert rank({"a": over, "b": queued}, cfg=no_horizon) == ["a", "b"]


def test_a_replica_whose_readers_would_stall_loses_to_a_slower_start_elsewhere():
    # a: 0.20 s of prefill queued while a running reader has 0.05 s buffered: it would stall ~0.17 s.
    urgent = stats(queued_prefill_s=0.20, num_waiting=4, num_running=4, num_live=8, min_buffer_s=0.05,
                   waiting_prompt_blocks=8)
    # b: a longer queue, but every reader has seconds buffered.
    relaxed = stats(queued_prefill_s=0.25, num_waiting=5, num_running=4, num_live=9, min_buffer_s=3.0,
                    waiting_prompt_blocks=10)
    assert score_replica("a", urgent, InflightLoad(), NEW, CFG).ttft_s < \
        score_replica("b", relaxed, InflightLoad(), NEW, CFG).ttft_s
    assert rank({"a": urgent, "b": relaxed}) == ["b", "a"]
    # Without slack to protect, the shorter queue wins.
    assert rank({"a": dataclasses.replace(urgent, min_buffer_s=None), "b": relaxed}) == ["a", "b"]


def test_a_snapshot_whose_streams_have_all_ended_prices_no_stall_and_no_queue():
    """Stats are 0.3-1.5 s old when read: one taken at the last burst's start shows its readers with nothing
    buffered and their prefills queued. Once the ledger has seen every one of them end, neither remains."""
    stale = stats(num_running=3, num_waiting=1, num_live=4, min_buffer_s=0.0, queued_prefill_s=0.02,
                  waiting_prompt_blocks=2, sum_rate=24.0, waiting_rate=8.0)
    idle = stats()
    all_gone = InflightLoad(-4, -32.0, departed=4)
    three_gone = InflightLoad(-3, -24.0, departed=3)
    stale_score = score_replica("s", stale, all_gone, NEW, CFG, now=100.0)
    assert (stale_score.ttft_s, stale_score.ahead, stale_score.streams) == \
        (pytest.approx(score_replica("i", idle, InflightLoad(), NEW, CFG, now=100.0).ttft_s), 0, 0)
    assert rank_replicas({"a": stale, "b": idle}, {"a": all_gone}, NEW, CFG, 100.0) == ["a", "b"]  # a tie: ids
    # One of them may still be live, the least buffered for all the router knows: its stall is priced.
    partly = score_replica("s", stale, three_gone, NEW, CFG, now=100.0)
    assert partly.score_s > stale_score.score_s + CFG.ttft_tolerance_s
    assert rank_replicas({"a": stale, "b": idle}, {"a": three_gone}, NEW, CFG, 100.0) == ["b", "a"]


def test_utilisation_weight_knob_trades_a_little_ttft_for_headroom():
    hot = stats(sum_rate=480.0, num_running=30, num_live=30)  # starts it at once, Γ nearly used
    cool = stats(num_waiting=3, num_live=3, queued_prefill_s=0.06, waiting_prompt_blocks=6)  # 3 prefills ahead
    # At the default weight the two are within the tolerance and the replica that starts it at once wins; priced
    # higher, a nearly used Γ costs more than three prefills.
    assert rank({"a": hot, "b": cool}) == ["a", "b"]
    assert rank({"a": hot, "b": cool}, cfg=SlackRouterConfig(utilisation_weight_s=0.5)) == ["b", "a"]


def test_within_the_tolerance_fewer_prefills_ahead_win_then_lower_demand():
    quick_hot = stats(sum_rate=300.0, num_running=10, num_live=10)
    slower_cool = stats(num_waiting=1, num_live=1, queued_prefill_s=0.03, waiting_prompt_blocks=2)
    # 30 ms apart, within the default 50 ms: a cost-model difference that small is noise, a stream queued ahead
    # is not, so the replica that starts it at once wins despite 300 tok/s more demand.
    no_util = SlackRouterConfig(utilisation_weight_s=0.0)
    assert score_replica("b", slower_cool, InflightLoad(), NEW, no_util).ahead == 1
    assert rank({"a": quick_hot, "b": slower_cool}, cfg=no_util) == ["a", "b"]
    # The same queue on both: the lower demand wins, though its estimate is 30 ms slower.
    cool = stats(num_waiting=1, num_live=1, queued_prefill_s=0.03, waiting_prompt_blocks=2, waiting_rate=10.0)
    hot = stats(num_waiting=1, num_live=11, num_running=10, queued_prefill_s=0.001, waiting_prompt_blocks=2,
                sum_rate=300.0)
    assert rank({"a": hot, "b": cool}, cfg=no_util) == ["b", "a"]
    exact = SlackRouterConfig(utilisation_weight_s=0.0, ttft_tolerance_s=0.0)
    assert rank({"a": hot, "b": cool}, cfg=exact) == ["a", "b"]
    # Tiers are cut from the best remaining score: three replicas 40 ms apart form two tiers, not one chain.
    chain = {"a": stats(queued_prefill_s=0.0, sum_rate=300.0), "b": stats(queued_prefill_s=0.04, sum_rate=200.0),
             "c": stats(queued_prefill_s=0.08)}
    assert rank(chain, cfg=no_util) == ["b", "a", "c"]


def test_the_stats_queue_drains_with_time_and_bookings_count_ahead_while_starting():
    """Stats are read 0.3-1.5 s old: what they showed waiting has partly started by now, and a booking counts as
    a stream ahead only while it may still be starting (`starting_s`)."""
    s = stats(computed_at=100.0, num_waiting=2, num_live=2, queued_prefill_s=0.04, waiting_prompt_blocks=4)
    assert prefill_queue(s, 100.0) == (pytest.approx(0.04), 2)
    assert prefill_queue(s, 100.03) == (pytest.approx(0.01), 1)  # one of the two is still ahead
    assert prefill_queue(s, 101.0) == (0.0, 0)
    assert prefill_queue(s, 99.0) == (pytest.approx(0.04), 2)  # a clock behind the replica's: nothing drained
    booked = InflightLoad(2, 20.0, ((100.95, 32), (101.0, 32)))
    assert score_replica("a", s, booked, NEW, CFG, now=101.02).ahead == 2
    assert score_replica("a", s, booked, NEW, CFG, now=101.06).ahead == 1  # the first has started by now
    assert score_replica("a", s, booked, NEW, CFG, now=102.0).ahead == 0
    assert score_replica("a", s, booked, NEW, CFG).ahead == 2 + 2  # no clock: everything counts
    # Drained work no longer delays the newcomer: the same estimate as an idle replica's.
    assert score_replica("a", s, InflightLoad(), NEW, CFG, now=101.0).ttft_s == \
        pytest.approx(score_replica("b", stats(), InflightLoad(), NEW, CFG).ttft_s)


def test_booked_prompts_queue_one_behind_the_other_and_count_until_their_prefill_ends():
    """Each booking reaches the replica `starting_s` after it was booked and is prefilled behind the one before."""
    per_token = 1e-4  # a 1000-token prompt: 0.1 s of prefill
    short, long_ = ((100.0, 20),), ((100.0, 1000),)
    assert booked_queue(short, per_token, 0.1, 100.05) == (pytest.approx(0.002), 1)  # still on its way: all left
    assert booked_queue(short, per_token, 0.1, 100.103) == (0.0, 0)  # about a starting window, as before
    assert booked_queue(long_, per_token, 0.1, 100.15) == (pytest.approx(0.05), 1)  # half its prefill left
    assert booked_queue(long_, per_token, 0.1, 100.21) == (0.0, 0)
    # A short prompt booked just after a long one waits for it: it is still starting when the long one is done.
    both = ((100.0, 1000), (100.01, 20))
    left, count = booked_queue(both, per_token, 0.1, 100.15)
    assert count == 2 and left == pytest.approx(0.05 + 0.002)
    assert booked_queue(both, per_token, 0.1, 100.201) == (pytest.approx(0.001), 1)
    assert booked_queue(both, per_token, 0.1, None) == (pytest.approx(0.102), 2)  # no clock: everything counts


def test_a_short_prompt_avoids_the_twin_still_prefilling_a_long_one_booked_there():
    """`tokenflow bench routing --long-prompt-share 0.15`: a 1024-token prompt held its replica's steps for about
    0.15 s here; counted for a flat 0.1 s starting window, it no longer delayed the next arrivals there after that,
    and the twins looked equal while one was still busy with it."""
    a, b = stats(), stats(num_running=3, num_live=3, sum_rate=30.0)  # b: more streams, so only a's queue decides
    long_booked = InflightLoad(1, 10.0, ((100.0, 1024),), 100.0)  # 0.32 s of prefill at the default price
    short_booked = InflightLoad(1, 10.0, ((100.01, 40),), 100.01)
    now = 100.25  # past the starting window of both
    order = rank_replicas({"a": a, "b": b}, {"a": long_booked, "b": short_booked}, NEW, CFG, now)
    assert order == ["b", "a"]
    busy = score_replica("a", a, long_booked, NEW, CFG, now)
    assert busy.ahead == 1 and busy.ttft_s > score_replica("b", b, short_booked, NEW, CFG, now).ttft_s + 0.1
    # Once its prefill is done, nothing is ahead there, and a, with fewer live streams, takes the next.
    later = 100.0 + 0.1 + 1024 * a.prefill_s_per_token + 0.01
    assert score_replica("a", a, long_booked, NEW, CFG, later).ahead == 0
    assert rank_replicas({"a": a, "b": b}, {"a": long_booked, "b": short_booked}, NEW, CFG, later) == ["a", "b"]


def test_a_stale_replica_is_not_shunned_for_bookings_a_fresh_one_has_absorbed():
    """Seen through Serve's proxy: one replica's stats had just been refreshed (its bookings absorbed, its queue
    nearly empty), its twin's were 1.2 s old with 17 bookings since, priced with an idle replica's prior costs,
    and the next 7 streams all went to the fresh one. Bookings older than `starting_s` have started: the two
    are equal, and the stream counts ahead (none) and then demand decide."""
    fresh = stats(computed_at=101.0, admitted_total=17, num_running=17, num_live=17, sum_rate=500.0,
                  prefill_fixed_s=0.003, prefill_s_per_token=0.0002, device_blocks_free=120)
    stale = stats(computed_at=99.8, prefill_fixed_s=0.02, prefill_s_per_token=0.0005)
    booked = InflightLoad(17, 510.0, tuple((99.9 + 0.05 * i, 130) for i in range(17)), 100.7)
    ledger_free = stale.device_blocks_free - 17 * stale.blocks_for(130)
    assert ledger_free > 0  # memory fits on both: only the queue estimate differs
    now = 101.02
    order = rank_replicas({"fresh": fresh, "stale": stale}, {"stale": booked}, NEW, CFG, now)
    assert order == ["fresh", "stale"]  # neither has a stream still starting; the fresh one 10 tok/s less demand...
    picks = []
    loads = {"fresh": InflightLoad(), "stale": booked}
    for i in range(8):  # ... and then they take turns: a burst of 8 a few ms apart lands 4/4
        t = now + 0.004 * i
        rid = rank_replicas({"fresh": fresh, "stale": stale}, loads, NewStream(10.0, 40), CFG, t)[0]
        old = loads[rid]
        loads[rid] = InflightLoad(old.count + 1, old.rate + 10.0, (*old.pending, (t, 40)), t)
        picks.append(rid)
    assert Counter(picks) == {"fresh": 4, "stale": 4}, picks


def test_a_cluster_of_arrivals_alternates_even_when_demand_differs():
    """Arrivals a few ms apart each start behind those booked just before them on the same replica: the one with
    fewer still starting takes the next, even if its demand is higher (live streams, then demand, decide between
    equal queues)."""
    light = stats(sum_rate=100.0, num_running=10, num_live=10)
    heavy = stats(sum_rate=300.0, num_running=10, num_live=10)
    loads = {"light": InflightLoad(), "heavy": InflightLoad()}
    picks = []
    for i in range(6):
        t = 100.0 + 0.01 * i
        rid = rank_replicas({"light": light, "heavy": heavy}, loads, NEW, CFG, t)[0]
        old = loads[rid]
        loads[rid] = InflightLoad(old.count + 1, old.rate + NEW.rate, (*old.pending, (t, 32)), t)
        picks.append(rid)
    assert picks == ["light", "heavy"] * 3
    # Spread out (each short stream started and ended before the next arrives), the lower demand takes them all.
    loads = {"light": InflightLoad(), "heavy": InflightLoad()}
    picks = []
    for i in range(3):
        t = 100.0 + 0.5 * i
        rid = rank_replicas({"light": light, "heavy": heavy}, loads, NEW, CFG, t)[0]
        loads[rid] = InflightLoad(last_booked_at=t)
        picks.append(rid)
    assert picks == ["light"] * 3
    # Between equal queues, fewer live streams before lower demand: 12 slow readers against 10 faster ones.
    many_slow = stats(sum_rate=60.0, num_running=12, num_live=12)
    assert rank_replicas({"slow": many_slow, "heavy": heavy}, {}, NEW, CFG, 100.0) == ["heavy", "slow"]


def test_ties_are_broken_deterministically_by_headroom_blocks_then_id():
    same = stats()
    assert rank({"r2": same, "r0": same, "r1": same}) == ["r0", "r1", "r2"]
    assert rank({"r1": same, "r2": same, "r0": same}) == ["r0", "r1", "r2"]
    # Equal scores, more free blocks first (memory is not short on either, so it only breaks the tie).
    assert rank({"a": stats(device_blocks_free=100), "b": stats(device_blocks_free=200)}) == ["b", "a"]


def test_idle_replicas_take_turns_with_light_sequential_load():
    """Each stream finishes before the next arrives: the stats never change, no booking is left, and the least
    recently chosen replica takes the next one instead of all of them landing on the smallest id."""
    idle = {rid: stats() for rid in ("a", "b", "c")}
    ledger = InflightLedger()
    picks = []
    for i in range(6):
        order = rank(idle, {rid: ledger.load(rid) for rid in idle})
        ledger.book(f"q{i}", order[0], now=float(i), rate=NEW.rate, prompt_tokens=NEW.prompt_tokens)
        ledger.complete(f"q{i}", float(i))
        picks.append(order[0])
    assert picks == ["a", "b", "c", "a", "b", "c"]


@pytest.mark.parametrize("n", [2, 3, 5])
def test_in_flight_bookings_spread_a_burst_of_2n_evenly_over_stale_stats(n):
    stale = {f"r{i}": stats(admitted_total=7) for i in range(n)}  # never refreshed during the burst
    ledger = InflightLedger()
    for rid, s in stale.items():
        ledger.observe(rid, s.admitted_total, s.finished_total)
    for i in range(2 * n):
        order = rank(stale, {rid: ledger.load(rid) for rid in stale})
        ledger.book(f"req{i}", order[0], now=0.0, rate=NEW.rate, prompt_tokens=NEW.prompt_tokens)
    assert Counter(ledger.replica_of(f"req{i}") for i in range(2 * n)) == {rid: 2 for rid in stale}


def test_a_noisy_capacity_estimate_does_not_skew_a_burst():
    """Seen on Serve: one replica's (stale) Γ at 675 tok/s, its twin's at 1738. Both start every stream at once,
    so the 8 identical streams split by demand, 4/4, not in proportion to the estimates (2/6)."""
    twins = {"a": stats(capacity_tok_s=675.0), "b": stats(capacity_tok_s=1738.0)}
    ledger = InflightLedger()
    for i in range(8):
        order = rank(twins, {rid: ledger.load(rid) for rid in twins}, NewStream(8.0, 40))
        ledger.book(f"q{i}", order[0], now=0.0, rate=8.0, prompt_tokens=40)
    assert Counter(ledger.replica_of(f"q{i}") for i in range(8)) == {"a": 4, "b": 4}


def test_without_bookings_the_same_stale_stats_herd():
    """The failure the bookings exist for (ray-notes §6.2): every pick of the burst is the same replica."""
    stale = {f"r{i}": stats() for i in range(3)}
    assert {rank(stale)[0] for _ in range(6)} == {"r0"}


def test_replicas_without_stats_fall_back_to_an_even_spread_by_stream_count():
    assert rank({"b": None, "a": None, "c": None}) == ["a", "b", "c"]
    loads = {"a": InflightLoad(count=2), "b": InflightLoad(), "c": InflightLoad(count=1)}
    assert rank({"a": None, "b": None, "c": None}, loads) == ["b", "c", "a"]
    # One replica just started (no stats yet): counted against the others' live streams, not their scores.
    assert rank({"old": stats(num_running=3, num_live=3), "new": None}, {"new": InflightLoad(count=1)}) == \
        ["new", "old"]
    ledger = InflightLedger()
    picks = []
    for i in range(6):
        order = rank({"a": None, "b": None, "c": None}, {r: ledger.load(r) for r in "abc"})
        ledger.book(f"q{i}", order[0], 0.0, 0.0, 8)
        picks.append(order[0])
    assert Counter(picks) == {"a": 2, "b": 2, "c": 2}


def test_a_replica_that_has_run_no_prompt_is_priced_like_the_cheapest_measured_one():
    """Its costs are the prior's guess (here 10x a measured twin's): priced by them it would never get the stream
    it needs to learn from. Taken at the better of prior and measured peer, a burst spreads evenly, and it is
    first while it holds fewer streams."""
    measured = stats(prefill_fixed_s=0.002, prefill_s_per_token=0.00003, decode_step_s=0.004, num_running=2,
                     num_live=2)
    cold = stats(prefill_fixed_s=0.03, prefill_s_per_token=0.0005, decode_step_s=0.02, prefill_samples=0)
    assert score_replica("cold", cold, InflightLoad(), NEW, CFG).ttft_s > \
        score_replica("m", measured, InflightLoad(), NEW, CFG).ttft_s + CFG.ttft_tolerance_s  # beyond the tie
    assert rank({"m": measured, "cold": cold}) == ["cold", "m"]  # tied on price; fewer streams first
    ledger = InflightLedger()
    for i in range(8):
        order = rank({"m": measured, "cold": cold}, {r: ledger.load(r) for r in ("m", "cold")})
        ledger.book(f"q{i}", order[0], now=0.0, rate=10.0, prompt_tokens=32)
    assert Counter(ledger.replica_of(f"q{i}") for i in range(8)) == {"cold": 4, "m": 4}  # priced alone: 0/8
    # An optimistic prior is kept, and with no measured replica at all every replica keeps its own prices.
    cheap_prior = dataclasses.replace(cold, prefill_s_per_token=0.00001)
    assert rank({"m": measured, "cold": cheap_prior})[0] == "cold"
    assert rank({"b": dataclasses.replace(cold, prefill_s_per_token=0.005), "a": cold}) == ["a", "b"]
    with pytest.raises(ValueError, match="prefill_samples"):
        stats(prefill_samples=-1)


def test_twins_whose_first_prompts_were_measured_10x_apart_still_split_a_burst():
    """A few noisy first steps are not the replica's cost: priced by them, 8 streams 50 ms apart all went to the
    faster-looking twin (the score's gap is past the tie tolerance and nothing in it grows with the router's own
    bookings at low load), and the other never got the prompts that would correct its estimate. Below
    `min_prefill_samples` each is priced as the better of its own and the cheapest measured replica's costs."""
    fast = stats(prefill_fixed_s=0.002, prefill_s_per_token=0.00003, decode_step_s=0.004, prefill_samples=2)
    slow = stats(prefill_fixed_s=0.02, prefill_s_per_token=0.0003, decode_step_s=0.04, prefill_samples=2)
    assert score_replica("s", slow, InflightLoad(), NEW, CFG).score_s > \
        score_replica("f", fast, InflightLoad(), NEW, CFG).score_s + CFG.ttft_tolerance_s  # beyond the tie

    def burst(cfg: SlackRouterConfig, fast_stats: ReplicaStats, slow_stats: ReplicaStats) -> Counter:
        ledger = InflightLedger()
        for i in range(8):
            now = 100.0 + 0.05 * i
            ledger.expire(now)
            order = rank_replicas({"f": fast_stats, "s": slow_stats}, {r: ledger.load(r) for r in "fs"}, NEW, cfg,
                                  now)
            ledger.book(f"q{i}", order[0], now=now, rate=10.0, prompt_tokens=32)
        return Counter(ledger.replica_of(f"q{i}") for i in range(8))

    assert burst(CFG, fast, slow) == {"f": 4, "s": 4}
    # The defect, as it was (every measured replica's costs taken as they are): 7 or 8 of 8 on one twin.
    assert burst(SlackRouterConfig(min_prefill_samples=1), fast, slow)["f"] >= 7
    # Once both estimates rest on enough steps they count: the replica measured slow takes fewer.
    settled = {"prefill_samples": CFG.min_prefill_samples}
    split = burst(CFG, dataclasses.replace(fast, **settled), dataclasses.replace(slow, **settled))
    assert split["f"] > split["s"]
    with pytest.raises(ValueError, match="min_prefill_samples"):
        SlackRouterConfig(min_prefill_samples=-1)


def test_a_burst_on_measured_twins_whose_estimates_drifted_apart_is_split():
    """A CI run's burst of 8 went 8/0 over two equal, well-measured replicas: on a shared box one twin's learned
    costs can read 2x the other's, the score's gap passes the tie tolerance, and counting streams ahead only broke
    ties. Each booked stream still starting now delays the next one there by its prefill, priced at the cheapest
    replica's rate (one price everywhere: a replica's own noisy estimate times its bookings would split unevenly)."""
    new = NewStream(rate=8.0, prompt_tokens=99)  # the Serve test's paced stream over HTTP
    a = stats(decode_step_s=0.011, prefill_fixed_s=0.011, prefill_s_per_token=0.00037)  # as a replica measured
    b = stats(decode_step_s=0.022, prefill_fixed_s=0.022, prefill_s_per_token=0.00074)  # its twin, read 2x
    gap = score_replica("b", b, InflightLoad(), new, CFG).score_s - score_replica("a", a, InflightLoad(), new,
                                                                                  CFG).score_s
    assert gap > CFG.ttft_tolerance_s  # beyond the tie: counts alone would never be consulted

    def burst(apart_s: float) -> Counter:
        ledger = InflightLedger()
        for i in range(8):
            now = 100.0 + apart_s * i
            order = rank_replicas({"a": a, "b": b}, {r: ledger.load(r) for r in "ab"}, new, CFG, now)
            ledger.book(f"q{i}", order[0], now, new.rate, new.prompt_tokens)
        return Counter(ledger.replica_of(f"q{i}") for i in range(8))

    assert burst(0.005) == {"a": 4, "b": 4}
    # (Counting them only between tied scores, as before: 7/1.)
    # Spread past the starting window each arrival finds the earlier ones started, and the twin measured faster
    # takes them until its demand's share of Γ closes the gap (bookings still starting describe a burst only).
    assert burst(0.2)["a"] >= 7


def test_the_overload_term_prices_the_newcomers_unserved_share():
    """0 while the stream fits under Γ, its unfitted part's share across Γ, 1 on a replica already over Γ; an
    unpaced stream (rate 0) the replica's per-reader share of the shortfall."""
    assert unserved_share(400.0, 50.0, 500.0) == 0.0
    assert unserved_share(480.0, 40.0, 500.0) == pytest.approx(0.5)
    assert unserved_share(600.0, 40.0, 500.0) == 1.0
    assert unserved_share(600.0, 0.0, 500.0) == pytest.approx(100.0 / 600.0)
    assert unserved_share(0.0, 0.0, 500.0) == 0.0
    over = score_replica("a", stats(sum_rate=600.0, num_live=20, num_running=20), InflightLoad(), NEW, OVERLOAD_ON)
    fits = score_replica("b", stats(sum_rate=400.0, num_live=20, num_running=20), InflightLoad(), NEW, OVERLOAD_ON)
    # Over Γ the utilisation term stops growing (capped at a full Γ): the overload term speaks there.
    expected = OVERLOAD_ON.overload_horizon_s + OVERLOAD_ON.utilisation_weight_s * (1 - 410 / 500)
    assert over.score_s - fits.score_s == pytest.approx(expected)


@pytest.mark.parametrize("cfg", [CFG, OVERLOAD_ON], ids=["default", "overload_on"])
def test_twins_both_over_capacity_split_a_burst_by_count_whatever_their_capacity_estimates(cfg):
    """In an overload (`tokenflow bench routing`: Σ 1920 tok/s asked of about 1400 delivered) a newcomer's rate is
    all shortfall on either twin. Priced as each replica's per-reader starvation (D − Γ)/D, the split equalised D/Γ:
    here 0/8 (and the utilisation term growing past Γ alone: 2/6)."""
    a = stats(sum_rate=1000.0, num_running=20, num_live=20, capacity_tok_s=600.0)
    b = stats(sum_rate=1000.0, num_running=20, num_live=20, capacity_tok_s=900.0)
    new = NewStream(rate=30.0, prompt_tokens=32)
    ledger = InflightLedger()
    for i in range(8):
        now = 100.0 + 0.2 * i  # past the starting window: streams ahead do not decide, live streams do
        order = rank_replicas({"a": a, "b": b}, {r: ledger.load(r) for r in "ab"}, new, cfg, now)
        ledger.book(f"q{i}", order[0], now, new.rate, new.prompt_tokens)
    assert Counter(ledger.replica_of(f"q{i}") for i in range(8)) == {"a": 4, "b": 4}
    # Where one twin still has room, it takes the stream (the overload term, or the lower demand between ties).
    roomy = dataclasses.replace(b, sum_rate=800.0)
    assert rank_replicas({"a": a, "b": roomy}, {}, new, cfg, 100.0) == ["b", "a"]


def test_prompt_estimates_and_their_knob():
    assert prompt_tokens_estimate((1, 2, 3), None, CFG) == 3
    assert prompt_tokens_estimate("héllo", None, CFG) == 6  # bytes: the embedded tokenizer is byte-level
    assert prompt_tokens_estimate("a" * 40, None, SlackRouterConfig(bytes_per_token=4.0)) == 10
    assert prompt_tokens_estimate(None, (("user", "abcd"), ("system", "ef")), CFG) == len("userabcdsystemef")
    assert prompt_tokens_estimate("", None, CFG) == 1
    # Over HTTP only the body's size is known: the JSON around the prompt is not prompt.
    assert http_prompt_tokens(128 + 40, CFG) == 40
    assert http_prompt_tokens(60, CFG) == 1
    assert http_prompt_tokens(200 + 80, SlackRouterConfig(http_envelope_bytes=200, bytes_per_token=4.0)) == 20


def test_config_and_stats_are_validated():
    for bad in ({"overload_horizon_s": -1}, {"inflight_ttl_s": 0}, {"bytes_per_token": float("inf")},
                {"default_rate": -0.5}, {"http_envelope_bytes": -1}, {"http_envelope_bytes": 1.5}):
        with pytest.raises(ValueError):
            SlackRouterConfig(**bad)
    with pytest.raises(ValueError, match="num_live"):
        stats(num_running=1)
    with pytest.raises(ValueError, match="capacity_tok_s"):
        stats(capacity_tok_s=float("nan"))
    with pytest.raises(ValueError, match="unknown"):
        ReplicaStats.from_dict({**stats().to_dict(), "extra": 1})
    assert ReplicaStats.from_dict(stats(min_buffer_s=1.5).to_dict()) == stats(min_buffer_s=1.5)

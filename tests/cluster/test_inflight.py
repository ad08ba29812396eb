"""InflightLedger: bookings are pending until the replica's admitted_total counts them, absorbed while the stats
count them, and departed from completion until its finished_total does; rejected requests are forgotten."""

from __future__ import annotations

import pytest

from tokenflow_ray.cluster.inflight import InflightLedger


def test_a_fresh_snapshot_absorbs_as_many_oldest_bookings_as_it_newly_counts():
    ledger = InflightLedger()
    ledger.observe("a", 10, 10)
    for i in range(4):
        ledger.book(f"q{i}", "a", now=float(i), rate=5.0, prompt_tokens=10 + i)
    assert ledger.load("a").count == 4 and ledger.load("a").rate == 20.0
    ledger.observe("a", 12, 10)  # two of ours arrived
    assert ledger.load("a").prompt_tokens == (12, 13)
    assert [ledger.state_of(f"q{i}") for i in range(4)] == ["absorbed", "absorbed", "pending", "pending"]
    ledger.observe("a", 12, 10)  # the same snapshot again: nothing changes
    ledger.observe("a", 11, 10)  # an older snapshot delivered late: ignored
    assert ledger.load("a").count == 2
    ledger.observe("a", 20, 10)  # more arrivals than bookings (another router's too): none pending, not negative
    assert ledger.load("a").count == 0 and len(ledger) == 4


def test_departures_subtract_until_the_finished_total_shows_them():
    ledger = InflightLedger()
    ledger.observe("a", 0, 0)
    ledger.book("q0", "a", 0.0, 8.0, 4)
    ledger.book("q1", "a", 0.0, 8.0, 4)
    ledger.observe("a", 2, 0)
    ledger.complete("q0", 1.0)  # the stats still count it live
    assert ledger.state_of("q0") == "departed"
    assert (ledger.load("a").count, ledger.load("a").rate, ledger.load("a").departed) == (-1, -8.0, 1)
    ledger.observe("a", 2, 1)
    assert ledger.state_of("q0") is None and (ledger.load("a").count, ledger.load("a").departed) == (0, 0)


def test_finishes_the_stats_show_before_the_router_hears_of_them_are_not_counted_twice():
    """The engine retires a stream before its response ends, so a snapshot often counts a finish first. That
    completion must not then subtract again from stats that no longer count the stream: for ttl_s the replica
    would read lighter than it is and draw the next burst."""
    ledger = InflightLedger()
    ledger.observe("a", 0, 0)
    for i in range(4):
        ledger.book(f"q{i}", "a", 0.0, 8.0, 4)
    ledger.observe("a", 4, 0)  # all four live there
    ledger.observe("a", 4, 3)  # three finished, none heard of yet
    assert ledger.load("a").count == 0
    for i in range(3):
        ledger.complete(f"q{i}", 1.0)
        assert ledger.state_of(f"q{i}") is None
        assert (ledger.load("a").count, ledger.load("a").departed) == (0, 0)
    ledger.complete("q3", 1.1)  # no finish counted for it yet: a departure until the stats show one
    assert (ledger.load("a").count, ledger.load("a").rate, ledger.load("a").departed) == (-1, -8.0, 1)
    ledger.observe("a", 4, 4)
    assert len(ledger) == 0 and ledger.load("a").count == 0


def test_finishes_beyond_our_live_streams_are_another_routers():
    ledger = InflightLedger()
    ledger.observe("a", 0, 0)
    ledger.book("q0", "a", 0.0, 8.0, 4)
    ledger.book("q1", "a", 0.0, 8.0, 4)
    ledger.observe("a", 2, 0)
    ledger.complete("q0", 1.0)  # heard of before the stats count it
    ledger.observe("a", 12, 10)  # ten finishes: q0, and nine not ours (at most q1 among them)
    assert ledger.state_of("q0") is None and ledger.state_of("q1") == "absorbed"
    ledger.book("q2", "a", 2.0, 8.0, 4)
    ledger.observe("a", 13, 10)
    ledger.complete("q1", 3.0)  # one unheard finish may be q1's: retired at once
    ledger.complete("q2", 3.0)  # the other unheard ones were not ours: q2 departs
    assert (ledger.state_of("q1"), ledger.state_of("q2")) == (None, "departed")


def test_the_first_snapshot_keeps_the_bookings_it_may_or_may_not_include():
    ledger = InflightLedger()
    ledger.book("q", "a", 0.0, 0.0, 4)
    ledger.observe("a", 3, 0)
    assert ledger.load("a").count == 1
    ledger.observe("a", 4, 0)
    assert ledger.load("a").count == 0 and ledger.state_of("q") == "absorbed"


def test_rejected_accepted_moved_rebooked_and_lost_replicas():
    ledger = InflightLedger()
    ledger.observe("a", 0, 0)
    ledger.observe("b", 0, 0)
    ledger.book("q1", "a", 0.0, 1.0, 4)
    ledger.book("q2", "a", 0.0, 2.0, 4)
    ledger.complete("q1", 0.5)  # never accepted: rejected or never sent
    assert ledger.replica_of("q1") is None
    ledger.accepted("q2", "b")  # accepted by b (a was full)
    assert (ledger.load("a").rate, ledger.load("b").rate) == (0.0, 2.0)
    ledger.complete("q2", 0.6)  # accepted, then done before any snapshot: counts for nothing, awaits both totals
    assert ledger.load("b").count == 0 and ledger.state_of("q2") == "pending"
    ledger.observe("b", 1, 0)  # admitted in this snapshot, still live there: a departure now
    assert ledger.state_of("q2") == "departed" and ledger.load("b").count == -1
    ledger.observe("b", 1, 1)
    assert ledger.replica_of("q2") is None
    ledger.book("q3", "a", 1.0, 1.0, 4)
    ledger.book("q3", "b", 1.1, 1.0, 4)  # routing picked again for the same request: one booking, moved
    assert (ledger.load("a").count, ledger.load("b").count) == (0, 1)
    ledger.complete("unknown", 2.0)
    ledger.drop_replica("b")
    assert len(ledger) == 0 and ledger.replica_ids() == {"a"}


def test_ttl_knob_expires_unconfirmed_bookings_and_departures():
    ledger = InflightLedger(ttl_s=2.0)
    ledger.observe("a", 0, 0)
    ledger.book("old", "a", 0.0, 0.0, 4)
    ledger.book("new", "a", 1.5, 0.0, 4)
    ledger.expire(1.9)
    assert ledger.load("a").count == 2
    ledger.expire(2.0)
    assert ledger.replica_of("old") is None and ledger.replica_of("new") == "a"
    ledger.observe("a", 1, 0)
    ledger.complete("new", 3.0)
    ledger.expire(4.9)
    assert ledger.state_of("new") == "departed"
    ledger.expire(5.0)  # the stats never showed it finish: forgotten, not subtracted for ever
    assert ledger.replica_of("new") is None
    with pytest.raises(ValueError):
        InflightLedger(ttl_s=0)

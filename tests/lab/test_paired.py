"""Paired round-by-round comparison (lab/paired.py): ratios, interval, wins, verdict."""

from __future__ import annotations

import math

import pytest

from tokenflow_ray.lab.paired import compare_rounds, paired_ratio, sign_test


def test_a_steady_lead_is_better_and_its_interval_excludes_one():
    b = [100.0, 140.0, 90.0, 120.0, 110.0, 130.0]  # the box drifts between pairs
    a = [x * f for x, f in zip(b, (1.10, 1.12, 1.08, 1.11, 1.09, 1.10))]
    r = paired_ratio("effective_tput", a, b, higher_is_better=True)
    assert r.pairs == 6 and (r.wins, r.losses) == (6, 0) and r.sign_p == pytest.approx(2 / 64)
    assert r.verdict == "better"
    assert 1.0 < r.low <= r.geo_mean <= r.high < 1.13
    assert r.geo_mean == pytest.approx(math.exp(sum(math.log(x / y) for x, y in zip(a, b)) / 6))


def test_lower_is_better_metrics_flip_the_verdict_and_the_wins():
    b = [0.50, 0.70, 0.40, 0.60]
    a = [x * 0.7 for x in b]
    a += [x * 0.72 for x in b]  # 8 pairs: few enough pairs all one way are not a verdict (next test)
    b += b
    r = paired_ratio("ttft_p99_s", a, b, higher_is_better=False)
    assert r.verdict == "better" and r.wins == 8 and r.geo_mean == pytest.approx(0.71, abs=0.01)
    worse = paired_ratio("ttft_p99_s", b, a, higher_is_better=False)
    assert worse.verdict == "worse" and (worse.wins, worse.losses) == (0, 8)


def test_a_few_pairs_all_one_way_are_no_verdict():
    # 3 pairs, each 8% ahead: the bootstrap's interval is clear of 1, but 3 of 3 happens 1 time in 4 by chance.
    r = paired_ratio("effective_tput", [108.0, 97.2, 129.6], [100.0, 90.0, 120.0], True)
    assert r.low > 1.0 and r.sign_p == pytest.approx(0.25) and r.verdict == "tie"
    assert paired_ratio("x", [1.1] * 6, [1.0] * 6, True).verdict == "better"  # 6 of 6: p = 1/32


def test_the_sign_test_is_exact_and_two_sided():
    assert sign_test(5, 15) == pytest.approx(2 * sum(math.comb(20, i) for i in range(6)) / 2 ** 20)  # 0.041
    assert sign_test(10, 10) == 1.0 and sign_test(0, 0) == 1.0 and sign_test(3, 0) == sign_test(0, 3) == 0.25


def test_noise_around_one_is_a_tie_even_when_the_medians_differ():
    # Medians 1.05 apart, but the pairs go both ways: the interval straddles 1.
    a = [105.0, 80.0, 130.0, 95.0, 120.0]
    b = [95.0, 90.0, 115.0, 100.0, 110.0]
    r = paired_ratio("effective_tput", a, b, higher_is_better=True)
    assert r.verdict == "tie" and r.low < 1.0 < r.high and r.wins == 3


def test_the_interval_is_seeded_and_narrows_with_more_pairs():
    import random

    rng = random.Random(1)
    ratios = [math.exp(rng.gauss(0.02, 0.08)) for _ in range(40)]
    few = paired_ratio("x", ratios[:5], [1.0] * 5, True)
    many = paired_ratio("x", ratios, [1.0] * 40, True)
    assert few == paired_ratio("x", ratios[:5], [1.0] * 5, True)  # same seed, same interval
    assert many.high - many.low < few.high - few.low


def test_pairs_without_a_positive_value_are_skipped_and_bad_input_raises():
    r = paired_ratio("effective_tput", [0.0, 2.0, 3.0], [1.0, 1.0, 1.0], True)
    assert r.pairs == 2
    with pytest.raises(ValueError, match="same count"):
        paired_ratio("x", [1.0, 2.0], [1.0], True)
    with pytest.raises(ValueError, match="at least 2 pairs"):
        paired_ratio("x", [0.0, 2.0], [1.0, 1.0], True)
    with pytest.raises(ValueError, match="level"):
        paired_ratio("x", [1.0, 2.0], [1.0, 1.0], True, level=1.0)


def test_compare_rounds_pairs_by_round_and_leaves_out_metrics_without_pairs():
    a = [{"eff": 110.0, "p99": 0.5, "stall": 0.0}, {"eff": 120.0, "p99": 0.4, "stall": 0.0}]
    b = [{"eff": 100.0, "p99": 0.6, "stall": 1.0}, {"eff": 100.0, "p99": 0.5, "stall": 2.0}]
    out = compare_rounds(a, b, {"eff": True, "p99": False, "stall": False})
    assert set(out) == {"eff", "p99"}  # stall is 0 in every round of a: no ratio
    assert out["eff"].wins == 2 and out["p99"].wins == 2
    with pytest.raises(ValueError, match="same count"):
        compare_rounds(a, b[:1], {"eff": True})

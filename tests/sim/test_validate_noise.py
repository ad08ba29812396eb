"""validate's noise bookkeeping: policies whose real runs' ranges overlap are tied, and the ranking is compared
on every other pair (pure Python, no engine)."""

from tokenflow_ray.sim.validate import _same_order_beyond_noise, _ties


def _spread(**ranges):
    return {p: {"effective_tput": list(r)} for p, r in ranges.items()}


def test_overlapping_real_ranges_are_ties_and_disjoint_ones_are_not():
    spread = _spread(fcfs=(1800, 1900), andes=(1780, 1820), tokenflow=(2600, 2700))
    assert _ties(spread, "effective_tput") == [["andes", "fcfs"]]
    assert _ties(_spread(a=(1, 2), b=(2, 3)), "effective_tput") == [["a", "b"]]  # touching ranges overlap
    assert _ties(_spread(a=(1, 2), b=(2.01, 3)), "effective_tput") == []


def test_a_swap_inside_a_tie_is_forgiven_and_one_outside_is_not():
    real = {"fcfs": {"e": 1850}, "andes": {"e": 1803}, "tokenflow": {"e": 2795}}
    swapped = {"fcfs": {"e": 1720}, "andes": {"e": 1824}, "tokenflow": {"e": 2723}}
    assert _same_order_beyond_noise(real, swapped, "e", [["andes", "fcfs"]])
    assert not _same_order_beyond_noise(real, swapped, "e", [])
    wrong_first = {"fcfs": {"e": 1850}, "andes": {"e": 1803}, "tokenflow": {"e": 1000}}
    assert not _same_order_beyond_noise(real, wrong_first, "e", [["andes", "fcfs"]])

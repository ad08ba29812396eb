"""validate's noise bookkeeping: policies whose real runs' ranges overlap are tied, and the ranking is compared
on every other pair (pure Python, no engine)."""

from tokenflow_ray.lab.sim_validate import _same_order_beyond_noise, _ties


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


def test_calibration_takes_each_steps_median_over_runs_that_planned_the_same_steps():
    from tokenflow_ray.engine.step_time_model import StepTimeFit
    from tokenflow_ray.lab.sim_validate import _median_cost, _median_steps
    from tokenflow_ray.sim.cost import CalibratedStepCost, StepShape

    a, b = StepShape(4, 0, 100, 0.0, 4), StepShape(0, 64, 0, 2048.0, 1)
    runs = [[(a, 0.010), (b, 0.020)], [(a, 0.011), (b, 0.090)], [(a, 0.030), (b, 0.021)]]  # one slow step each
    assert _median_steps(runs) == [(a, 0.011), (b, 0.021)]
    other = [[(b, 0.02)], [(a, 0.01)]]  # different plans: pooled, nothing dropped
    assert sorted(t for _, t in _median_steps(other)) == [0.01, 0.02]
    fits = [CalibratedStepCost(StepTimeFit(f, d, 1e-4), 5e-7) for f, d in ((1e-3, 9e-5), (9e-3, 8e-5), (2e-3, 1e-5))]
    med = _median_cost(fits)
    assert (med.fit.fixed_s, med.fit.decode_s, med.fit.prefill_s, med.context_s) == (2e-3, 8e-5, 1e-4, 5e-7)

"""jobs/gpu_bench.py: the dry run end to end (every part, the shared file formats, without Ray or any package the
GPU image lacks), the orchestrator's handling of parts that fail or outlive their limit, and the time budget."""

from __future__ import annotations

import json

import pytest

from tokenflow_ray.bench.gpu.budget import PARTS, tasks, worst_case_s
from tokenflow_ray.bench.gpu.orchestrator import MAIN_JSON, BenchOptions, run_gpu_bench


def test_a_failing_or_overrunning_part_is_recorded_and_the_others_still_run(tmp_path):
    opts = BenchOptions(out_dir=tmp_path, mode="dry", parts=("attention", "parity", "graphs"),
                        limits={"attention": 4}, child="tests.bench.fake_gpu_child")
    report = run_gpu_bench(opts, progress=lambda _: None)
    attention, parity = report["parts"]["attention"], report["parts"]["parity"]
    assert attention["status"] == "timeout" and "4 s limit" in attention["error"]
    assert attention["result"]["first_half"] == {"max_abs": 1e-6}  # saved before the kill, kept
    assert parity["status"] == "error" and parity["error"] == "RuntimeError: boom"
    assert parity["result"]["float32"] == {"identical": 1, "of": 2} and "boom" in parity["log_tail"]
    assert report["parts"]["graphs"]["status"] == "ok"
    assert report["parts"]["step_grid"] == {"status": "skipped", "reason": "not in --parts"}
    assert json.loads((tmp_path / MAIN_JSON).read_text())["parts"]["parity"]["status"] == "error"


def test_tasks_get_no_more_than_what_is_left_of_the_budget(tmp_path):
    opts = BenchOptions(out_dir=tmp_path, mode="full", parts=("attention", "graphs", "copies"), budget_s=25,
                        child="tests.bench.fake_gpu_child")
    report = run_gpu_bench(opts, progress=lambda _: None)
    assert report["parts"]["attention"]["status"] == "timeout"
    # cut to what was left of the budget (less the orchestrator's reserve), not the part's own 30 s cap
    assert 10 <= report["parts"]["attention"]["limit_s"] <= 25 - 5 < PARTS["attention"].full_s
    assert report["parts"]["graphs"]["status"] == report["parts"]["copies"]["status"] == "skipped"
    assert "budget" in report["parts"]["graphs"]["reason"]
    with pytest.raises(ValueError, match="unknown"):
        BenchOptions(out_dir=tmp_path, parts=("attention", "nope"))


def test_the_budget_fits_8_minutes_and_quick_3():
    """The caps of every task a mode runs, plus the orchestrator's few seconds, fit the brief's limits; the
    docstring's table is these numbers."""
    import tokenflow_ray.bench.gpu.budget as budget

    assert worst_case_s("full") + 5 <= 480 and worst_case_s("quick") + 5 <= 180
    assert f"**{worst_case_s('full'):.0f}**" in budget.__doc__ and f"**{worst_case_s('quick'):.0f}**" in budget.__doc__
    assert PARTS["graphs"].limit_s("quick") is None and len(tasks("serving", "quick")) == 2

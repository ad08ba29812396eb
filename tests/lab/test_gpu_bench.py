"""jobs/gpu_bench.py: the dry run end to end (every part, the shared file formats, without Ray or any package the
GPU image lacks), the orchestrator's handling of parts that fail or outlive their limit, and the time budget."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tokenflow_ray.lab.gpu.budget import PART_NAMES, PARTS, SERVING_POLICIES, tasks, worst_case_s
from tokenflow_ray.lab.gpu.orchestrator import MAIN_JSON, BenchOptions, run_gpu_bench
from tokenflow_ray.lab.gpu.serving import FILE_KEYS, SAMPLES_COLUMNS
from tokenflow_ray.metrics.summary import PolicySummary

ROOT = Path(__file__).resolve().parents[2]
# Project dependencies the GPU image does not have: nothing the bench runs may import them.
NOT_IN_GPU_IMAGE = ("ray", "flash_attn", "matplotlib", "sklearn", "pyarrow", "fastapi", "rich", "torchmetrics")


def _blocking_dir(tmp_path: Path) -> Path:
    """A folder to put first on PYTHONPATH whose sitecustomize makes the missing packages absent in every process
    started with it (sys.modules[name] = None: `import name` raises ImportError, find_spec says not installed, as
    transformers' probes expect of a package that is not there)."""
    root = tmp_path / "not_in_image"
    root.mkdir()
    (root / "sitecustomize.py").write_text(
        f"import sys\nfor name in {NOT_IN_GPU_IMAGE!r}:\n    sys.modules[name] = None\n")
    return root


@pytest.mark.timeout(900)
def test_dry_run_runs_every_part_and_writes_the_shared_formats(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": f"{_blocking_dir(tmp_path)}:{ROOT}"}
    proc = subprocess.Popen([sys.executable, str(ROOT / "jobs" / "gpu_bench.py"), "--dry-run", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=tmp_path, text=True)
    try:
        log, _ = proc.communicate(timeout=880)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, log
    report = json.loads((out / MAIN_JSON).read_text())
    assert report["mode"] == "dry" and report["commit"]["source"] and report["wall_s"] > 0
    assert {"gpus", "torch", "torch_cuda", "triton", "transformers"} <= set(report["machine"])
    assert set(report["parts"]) == set(PART_NAMES)
    for name, part in report["parts"].items():
        assert part["status"] in ("ok", "unavailable"), (name, part.get("error"), part.get("log_tail"))
        assert part["wall_s"] > 0
    parts = report["parts"]
    # attention: SDPA within tolerance of the float64 reference in both dtypes; the others ok or unavailable
    backends = parts["attention"]["result"]["backends"]
    for dtype in ("float32", "bfloat16"):
        sdpa = backends[f"sdpa/{dtype}"]
        assert sdpa["status"] == "ok" and set(sdpa["cases"]) == {"decode", "prefill", "chunked_prefill", "mixed"}
        assert all(c["kv_write_exact"] and c["max_abs_vs_reference"] < sdpa["tolerance"] for c in sdpa["cases"].values())
        for name in ("flash", "triton"):
            entry = backends[f"{name}/{dtype}"]
            assert entry["status"] == "ok" or entry["status"] == "unavailable" and entry["reason"]
    f32 = parts["parity"]["result"]["float32"]
    assert f32["identical"] == f32["of"] == 2  # fp32 greedy is token-identical to HF
    grid = json.loads((out / "step_grid.json").read_text())
    assert {"device", "load_s", "backend", "gpu", "mem_alloc_gb", "runs", "probe_wall_s"} <= set(grid)
    for point in grid["runs"].values():
        assert {"batch", "prompt", "wall_s", "decode_step_ms_median", "decode_tok_s", "prefill_tok_s"} <= set(point)
        assert set(point["steps"][0]) == {"decodes", "prefill_tokens", "decode_context", "prefill_pairs", "sampled",
                                          "s", "model_s"}
        assert sum(s["sampled"] for s in point["steps"]) == point["batch"] * 8  # every output token, one step each
    assert grid["roofline"]["of_roofline"] > 0
    assert parts["copies"]["result"]["kv_transfer_roundtrip"]["max_abs"] == 0.0
    assert all(v["roundtrip_exact"] for k, v in parts["copies"]["result"].items() if k.startswith("kv_blocks_"))
    serving = parts["serving"]["tasks"]
    assert tuple(serving) == SERVING_POLICIES
    for policy, rec in serving.items():
        data = json.loads((out / rec["result"]["file"]).read_text())
        assert tuple(data) == FILE_KEYS and data["policy"] == policy and not data["stopped_early"]
        assert data["finished"] == data["requests"] == 16 and set(data["summary"]) == {
            f.name for f in dataclasses.fields(PolicySummary)}
        assert data["samples_columns"] == list(SAMPLES_COLUMNS) and all(len(r) == 6 for r in data["samples"])
        assert data["tokens_generated_all"] == sum(r[3] for r in data["request_list"]) == data["summary"]["total_tokens"]
        slow = rec["result"]["slow_steps"]
        assert 0 <= slow["share"] <= 1 and slow["steps"] == len(data["samples"])
    assert sorted(report["files"]) == sorted(p.name for p in out.iterdir()) and len(report["files"]) <= 8


def test_nothing_on_the_bench_path_imports_a_package_the_gpu_image_lacks():
    code = ("import sys\n"
            f"for name in {NOT_IN_GPU_IMAGE!r}:\n    sys.modules[name] = None  # import raises ImportError\n"
            "import importlib, runpy\n"
            f"for part in {PART_NAMES!r}:\n    importlib.import_module('tokenflow_ray.lab.gpu.' + part)\n"
            "for m in ('tokenflow_ray.lab.gpu.orchestrator', 'tokenflow_ray.lab.gpu.child',\n"
            "          'tokenflow_ray.runner.model_runner', 'tokenflow_ray.models.presets'):\n"
            "    importlib.import_module(m)\n"
            f"runpy.run_path({str(ROOT / 'jobs' / 'gpu_bench.py')!r}, run_name='not_main')\n"
            f"assert not [m for m in sys.modules if m.split('.')[0] in {NOT_IN_GPU_IMAGE!r} and sys.modules[m]]\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr


def test_a_failing_or_overrunning_part_is_recorded_and_the_others_still_run(tmp_path):
    opts = BenchOptions(out_dir=tmp_path, mode="dry", parts=("attention", "parity", "graphs"),
                        limits={"attention": 4}, child="tests.lab.fake_gpu_child")
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
                        child="tests.lab.fake_gpu_child")
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
    import tokenflow_ray.lab.gpu.budget as budget

    assert worst_case_s("full") + 5 <= 480 and worst_case_s("quick") + 5 <= 180
    assert f"**{worst_case_s('full'):.0f}**" in budget.__doc__ and f"**{worst_case_s('quick'):.0f}**" in budget.__doc__
    assert PARTS["graphs"].limit_s("quick") is None and len(tasks("serving", "quick")) == 2

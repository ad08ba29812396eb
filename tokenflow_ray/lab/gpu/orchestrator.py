"""Runs the bench's parts, each task in its own process under its limit, and writes `gpu_bench.json` after every
task (so a bench cut short still leaves its file): machine facts, the commit, and per part its status (ok, error,
timeout, partial, unavailable, skipped), wall time, limit, error, the end of its log when it failed, and its
results.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from tokenflow_ray.lab.gpu.budget import BUDGET_S, MIN_TASK_S, MODES, PART_NAMES, PARTS, tasks, worst_case_s
from tokenflow_ray.lab.gpu.context import COMMIT_ENV, json_safe, write_json_atomic
from tokenflow_ray.lab.gpu.machine import git_commit, machine_facts

MAIN_JSON = "gpu_bench.json"
ROOT = Path(__file__).resolve().parents[3]  # the project: what the parts' processes put on PYTHONPATH
RESERVE_S = 5.0  # of the bench's budget, kept for the orchestrator's own work after the last task
LOG_TAIL = 4000


@dataclass(frozen=True)
class BenchOptions:
    out_dir: Path
    mode: str = "full"  # full | quick | dry
    parts: tuple[str, ...] = PART_NAMES
    commit: str | None = None
    limits: dict[str, float] = field(default_factory=dict)  # per-task limit overrides, by part
    budget_s: float | None = None  # None: the mode's (480 s, quick 180 s, dry none); 0: none
    child: str = "tokenflow_ray.lab.gpu.child"  # the module a task's process runs (tests pass a stand-in)

    def __post_init__(self) -> None:
        object.__setattr__(self, "out_dir", Path(self.out_dir).resolve())  # the parts run from the project root
        if self.mode not in MODES:
            raise ValueError(f"mode: expected one of {', '.join(MODES)}, got {self.mode!r}")
        unknown = [p for p in (*self.parts, *self.limits) if p not in PART_NAMES]
        if unknown:
            raise ValueError(f"parts: unknown {unknown}; parts are {', '.join(PART_NAMES)}")
        if any(not (v > 0 and math.isfinite(v)) for v in self.limits.values()):
            raise ValueError("limits: seconds must be finite and > 0")

    @property
    def budget(self) -> float | None:
        b = BUDGET_S[self.mode] if self.budget_s is None else self.budget_s
        return b or None


class _Stop(Exception):
    """SIGTERM (e.g. `timeout`): end the running task and write what there is."""


def _on_sigterm(signum, frame):
    raise _Stop()


def run_task(opts: BenchOptions, part: str, task: str | None, limit_s: float, work: Path, env: dict) -> dict:
    name = part if task is None else f"{part}-{task}"
    result_path, log_path = work / f"{name}.json", work / f"{name}.log"
    cmd = [sys.executable, "-m", opts.child, "--part", part, "--mode", opts.mode,
           "--out", str(opts.out_dir), "--result", str(result_path), "--limit-s", f"{limit_s:.1f}"]
    if task is not None:
        cmd += ["--task", task]
    t = time.monotonic()
    timed_out = False
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        try:
            rc = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            timed_out, rc = True, None
        finally:
            if proc.poll() is None:  # past its limit, or the bench itself is being stopped
                proc.kill()
                proc.wait()
    wall = time.monotonic() - t
    result = _read(result_path)
    error = result.pop("error", None)
    status = "timeout" if timed_out else "error" if rc != 0 or error else \
        "unavailable" if result.get("unavailable") else "ok"
    rec = {"status": status, "wall_s": wall, "limit_s": limit_s, "rc": rc, "error": error, "result": result}
    if status != "ok":
        rec["log_tail"] = log_path.read_bytes()[-LOG_TAIL:].decode("utf-8", "replace")
        if timed_out:
            rec["error"] = f"killed at its {limit_s:.0f} s limit (results saved before are kept)"
    return rec


def _read(path: Path) -> dict:
    import json

    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _part_status(records: dict[str, dict]) -> str:
    statuses = {r["status"] for r in records.values()}
    if len(statuses) == 1:
        return statuses.pop()
    return "partial"


def run_gpu_bench(opts: BenchOptions, progress: Callable[[str], None] = print) -> dict:
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    commit = git_commit(ROOT, opts.commit)
    report: dict = {"bench": "jobs/gpu_bench.py", "mode": opts.mode,
                    "started_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    "commit": commit, "machine": machine_facts(),
                    "budget": {"whole_s": opts.budget, "worst_case_s": worst_case_s(opts.mode),
                               "limits_s": {p: opts.limits.get(p, PARTS[p].limit_s(opts.mode)) for p in PART_NAMES}},
                    "parts": {}, "files": []}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1", COMMIT_ENV: commit["commit"] or ""}
    main_path = opts.out_dir / MAIN_JSON
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        with tempfile.TemporaryDirectory(prefix="gpu_bench_") as work:
            for part in PART_NAMES:
                report["parts"][part] = _run_part(opts, part, Path(work), env, started, progress)
                _write(report, main_path, started)
    except (_Stop, KeyboardInterrupt):
        report["interrupted"] = True
        progress("gpu_bench: stopped; writing what there is")
    finally:
        signal.signal(signal.SIGTERM, previous)
        for part in PART_NAMES:
            report["parts"].setdefault(part, {"status": "skipped", "reason": "the bench was stopped before it"})
        _write(report, main_path, started)
    return report


def _run_part(opts: BenchOptions, part: str, work: Path, env: dict, started: float,
              progress: Callable[[str], None]) -> dict:
    if part not in opts.parts:
        return {"status": "skipped", "reason": "not in --parts"}
    limit = opts.limits.get(part, PARTS[part].limit_s(opts.mode))
    if limit is None:
        return {"status": "skipped", "reason": f"not in --{opts.mode} (see tokenflow_ray/lab/gpu/budget.py)"}
    records: dict[str, dict] = {}
    for task in tasks(part, opts.mode):
        label = part if task is None else f"{part}:{task}"
        left = math.inf if opts.budget is None else opts.budget - RESERVE_S - (time.monotonic() - started)
        if left < MIN_TASK_S:
            records[task or part] = {"status": "skipped", "reason": f"the bench's {opts.budget:.0f} s budget is spent"}
            progress(f"{label:<20} skipped (budget spent)")
            continue
        rec = run_task(opts, part, task, min(limit, left), work, env)
        records[task or part] = rec
        note = rec["result"].get("headline") or rec["error"] or ""
        progress(f"{label:<20} {rec['status']:<8} {rec['wall_s']:6.1f} s  {note}")
    if tasks(part, opts.mode) == (None,):
        return records[part]
    return {"status": _part_status(records), "wall_s": sum(r.get("wall_s", 0.0) for r in records.values()),
            "limit_s_per_task": limit, "tasks": records}


def _write(report: dict, path: Path, started: float) -> None:
    report["wall_s"] = time.monotonic() - started
    report["files"] = sorted(p.name for p in path.parent.iterdir() if p.is_file() and not p.name.startswith("."))
    if path.name not in report["files"]:
        report["files"] = sorted([*report["files"], path.name])
    write_json_atomic(path, json_safe(report), indent=1)

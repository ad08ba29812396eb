"""The house's layering: rooms in one declared order, imports only running down it, no import cycle between
modules, no source file over 400 lines, and the pure rooms free of torch and Ray.

A room is a top-level subpackage or module of tokenflow_ray (serve/ is three rooms and the app: its roles). An import
may name its own room or one declared before it; an import from a room declared later runs back up the house.
`python scripts/import_graph.py` draws the same picture (rooms, cycles, upward imports, long files). The rules in
words: docs/design.md §2.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tokenflow_ray"

# Low to high: each room may import the rooms above it in this list, never one below.
ROOMS: tuple[tuple[str, str], ...] = (
    ("checks", "the validation helpers every config and record uses; stdlib only"),
    ("cli_args", "the argument types and --json writer every command shares; stdlib only"),
    ("affinity", "pinning a process to CPUs of its own; stdlib only"),
    ("torch_threads", "torch's thread count for a block (torch imported on use)"),
    ("tokenizer", "the image tokenizer wing: a sibling of the LLM rooms, it uses only the utilities above"),
    ("metrics", "the reader model and stream metrics every figure is computed with; pure Python"),
    ("workloads", "seeded request workloads and the paper's experiment arms, for the simulator and the lab; pure"),
    ("client", "the paced HTTP streaming client and load generator (httpx), over the metrics"),
    ("engine", "the serving core: streams, KV accounting, scheduler and policies, LLMEngine; pure Python"),
    ("cluster", "routing, migration and autoscaling decisions, and the messages between processes; pure"),
    ("sim", "the simulator: the real engine and cluster policies on a virtual clock; pure"),
    ("layers", "attention backends, CPU and Triton kernels, packed linears: what models and runner share (torch)"),
    ("models", "model definitions and loading, on the layers"),
    ("runner", "the torch runner (a StepPlan in, a StepResult out) and build_engine, which joins it to the engine"),
    ("entrypoints", "the public offline face: LLM and `tokenflow generate`, on build_engine"),
    ("serve.control", "the Serve app's control plane: central actor, request router, autoscaling policy"),
    ("serve.http", "the Serve app's HTTP front: routes, bodies, errors, image routes, /metrics, stream port"),
    ("serve.replica", "the LLMServer replica around one engine: token path, central link, stats, migration"),
    ("serve", "the Serve app itself: its config, its assembly, `tokenflow serve` and the local Ray session"),
    ("lab", "benchmarks, the demo and the GPU bench: they measure everything below and nothing imports them"),
    ("cli", "the `tokenflow` console script: it wires every part's commands"),
    ("__init__", "the package's public face (LLM, SamplingParams), imported on first use"),
)
# Rooms that run without torch or Ray (the CPU-testable core, house rule 1): they import neither, anywhere.
PURE_ROOMS = ("checks", "cli_args", "metrics", "workloads", "engine", "cluster", "sim")
# Known exceptions, each with why and until when; each must still exist (a stale one fails).
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}
MAX_LINES = 400
ALLOWED_LONG: dict[str, str] = {}


def _graph_tool():
    """scripts/import_graph.py, loaded by path (scripts/ is not a package); registered, as its dataclasses need."""
    if "import_graph" not in sys.modules:
        spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["import_graph"] = module
        spec.loader.exec_module(module)
    return sys.modules["import_graph"]


@pytest.fixture(scope="module")
def report():
    tool = _graph_tool()
    return tool.analyse(PACKAGE, [room for room, _ in ROOMS], MAX_LINES)


def test_every_room_is_declared_once(report):
    names = [room for room, _ in ROOMS]
    assert len(names) == len(set(names))
    assert report.unknown_rooms == [], f"rooms missing from ROOMS (add each where it belongs): {report.unknown_rooms}"


def test_no_import_cycle_between_modules(report):
    assert report.cycles == [], "\n".join(" <-> ".join(c) for c in report.cycles)


def test_no_import_runs_back_up(report):
    upward = {(u.edge.source, u.edge.target): u for u in report.upward}
    unexpected = [f"{u.edge.source}:{u.edge.line} -> {u.edge.target} ({u.source_room} -> {u.target_room})"
                  for key, u in upward.items() if key not in ALLOWED_UPWARD]
    assert not unexpected, "imports running back up the declared order:\n" + "\n".join(unexpected)
    stale = set(ALLOWED_UPWARD) - set(upward)
    assert not stale, f"allowed upward imports that no longer exist (remove them): {sorted(stale)}"


def test_no_source_file_over_the_limit(report):
    long = {path: n for path, n in report.long_files.items() if path not in ALLOWED_LONG}
    assert not long, f"files over {MAX_LINES} lines: {long}"
    stale = set(ALLOWED_LONG) - set(report.long_files)
    assert not stale, f"allowed long files that are no longer long (remove them): {sorted(stale)}"


def test_pure_rooms_import_neither_torch_nor_ray():
    tool = _graph_tool()
    found = []
    for module, path in tool.module_files(PACKAGE).items():
        if tool.room_of(module, [room for room, _ in ROOMS]) not in PURE_ROOMS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            found += [f"{module}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in ("torch", "ray")]
    assert not found, "\n".join(found)


def test_the_tool_finds_what_it_is_meant_to(tmp_path):
    """The checks above can fail: a cycle, an upward import (in a function too), a type-only import (a layering
    edge but not a cycle), a relative import and a long file, in a package made for it."""
    pkg = tmp_path / "pkg"
    for folder in ("low", "high"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("from pkg.low import b\n\ndef f():\n    from pkg.high import c\n")
    (pkg / "low" / "b.py").write_text("from . import a\n")
    (pkg / "high" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.high import d\n"
                                       + "x = 1\n" * (MAX_LINES + 1))
    (pkg / "high" / "d.py").write_text("from pkg.high import c\n")
    report = _graph_tool().analyse(pkg, ["low", "high"], MAX_LINES)
    assert report.cycles == [["pkg.low.a", "pkg.low.b"]]  # c <-> d only through a type-only import
    assert [(u.edge.source, u.edge.target, u.edge.in_function) for u in report.upward] == [
        ("pkg.low.a", "pkg.high.c", True)]
    assert list(report.long_files) == ["pkg/high/c.py"]
    assert report.room_graph == {"high": [], "low": ["high"]}

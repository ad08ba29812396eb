"""Draw the package's import structure from its source (stdlib `ast` only, nothing is imported).

    python scripts/import_graph.py [--root tokenflow_ray] [--json PATH]

Prints the room-level graph (a room is a top-level subpackage or module of the package, or a subpackage the order
declares, such as serve.http), the import cycles between
modules, the imports that run back up the declared room order (tests/test_layering.py holds it) and the source
files over the size limit. Every import counts, at module level or inside a function; one under `if TYPE_CHECKING:`
never runs, so it counts for the layering but not for cycles. A relative import is resolved to its module.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_LINES = 400


@dataclass(frozen=True)
class ImportEdge:
    source: str  # the importing module, e.g. "tokenflow_ray.engine.scheduler"
    target: str  # the imported module (a package's `__init__` is named by the package)
    line: int
    in_function: bool  # inside a def: runs on the call, not on import
    type_only: bool = False  # under `if TYPE_CHECKING:`: never runs (a layering edge, not a cycle edge)


@dataclass(frozen=True)
class Upward:
    edge: ImportEdge
    source_room: str
    target_room: str


@dataclass(frozen=True)
class Report:
    room_graph: dict[str, list[str]]
    cycles: list[list[str]]
    upward: list[Upward]
    unknown_rooms: list[str]
    long_files: dict[str, int]


def module_files(package_dir: Path) -> dict[str, Path]:
    """Every module of the package by its dotted name; a package is named by its `__init__.py`."""
    root = package_dir.parent
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve_relative(module: str, is_package: bool, level: int, name: str | None) -> str:
    base = module.split(".")
    if not is_package:
        base.pop()
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _nodes_under(tree: ast.AST, kind) -> set[int]:
    """ids of every node inside a node that `kind(node)` picks."""
    inside = set()
    for node in ast.walk(tree):
        if kind(node):
            for child in ast.walk(node):
                inside.add(id(child))
    return inside


def _is_function(node: ast.AST) -> bool:
    return isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)


def _is_type_checking_block(node: ast.AST) -> bool:
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def module_imports(module: str, path: Path, modules: dict[str, Path], package: str) -> list[ImportEdge]:
    """The imports of one module into the package, each resolved to the deepest module it names."""
    tree = ast.parse(path.read_text(), filename=str(path))
    in_function = _nodes_under(tree, _is_function)
    type_only = set()
    for node in ast.walk(tree):
        if _is_type_checking_block(node):
            for stmt in node.body:  # the `else:` branch runs
                type_only |= {id(child) for child in ast.walk(stmt)}
    is_package = path.name == "__init__.py"
    edges = []
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = (
                _resolve_relative(module, is_package, node.level, node.module) if node.level else node.module or ""
            )
            # `from pkg import mod` names a module; `from mod import name` names the module itself.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for target in dict.fromkeys(targets):
            if not (target == package or target.startswith(package + ".")):
                continue
            while target not in modules and "." in target:  # `import a.b.c` where c is an attribute
                target = target.rsplit(".", 1)[0]
            if target != module:
                edges.append(ImportEdge(module, target, node.lineno, id(node) in in_function, id(node) in type_only))
    return edges


def room_of(module: str, rooms: list[str] | None = None) -> str:
    """The room of `tokenflow_ray.engine.scheduler` is `engine`: its top-level subpackage or module, or the longest
    declared room it is in (`serve.http` for `tokenflow_ray.serve.http.ingress`); the package's `__init__` is the
    room `__init__`."""
    parts = module.split(".")[1:]
    if not parts:
        return "__init__"
    for n in range(len(parts), 1, -1):
        if rooms is not None and ".".join(parts[:n]) in rooms:
            return ".".join(parts[:n])
    return parts[0]


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of more than one module: each is an import cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0

    def visit(node: str) -> None:  # recursion depth is bounded by the module count (a few hundred)
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(out)


def analyse(package_dir: Path, order: list[str] | None = None, max_lines: int = MAX_LINES) -> Report:
    """The whole picture; `order` lists the rooms low to high (None: no upward check)."""
    package = package_dir.name
    modules = module_files(package_dir)
    declared = list(order) if order is not None else None
    edges = [e for m, p in modules.items() for e in module_imports(m, p, modules, package)]
    graph: dict[str, set[str]] = {m: set() for m in modules}
    rooms: dict[str, set[str]] = {}
    for e in edges:
        if not e.type_only:
            graph[e.source].add(e.target)
        src, dst = room_of(e.source, declared), room_of(e.target, declared)
        rooms.setdefault(src, set())
        if src != dst:
            rooms[src].add(dst)
    upward, unknown = [], set()
    if order is not None:
        rank = {room: i for i, room in enumerate(order)}
        unknown = {room_of(m, declared) for m in modules} - set(rank)
        for e in edges:
            src, dst = room_of(e.source, declared), room_of(e.target, declared)
            if src in rank and dst in rank and rank[dst] > rank[src]:
                upward.append(Upward(e, src, dst))
    long_files = {}
    for path in sorted(package_dir.rglob("*.py")):
        n = len(path.read_text().splitlines())
        if n > max_lines:
            long_files[str(path.relative_to(package_dir.parent))] = n
    return Report(
        room_graph={r: sorted(d) for r, d in sorted(rooms.items())},
        cycles=strongly_connected(graph),
        upward=sorted(upward, key=lambda u: (u.edge.source, u.edge.line)),
        unknown_rooms=sorted(unknown),
        long_files=long_files,
    )


def declared_order() -> list[str] | None:
    """The room order that tests/test_layering.py declares (loaded by path: scripts/ is not a package)."""
    path = REPO / "tests" / "test_layering.py"
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location("_layering_rule", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [room for room, _reason in module.ROOMS]


def format_report(report: Report, order: list[str] | None) -> str:
    lines = ["rooms (-> the rooms each imports):"]
    listed = order + [r for r in report.room_graph if r not in order] if order else list(report.room_graph)
    for room in listed:
        if room in report.room_graph:
            lines.append(f"  {room} -> [{', '.join(report.room_graph[room])}]")
    lines.append(f"module cycles: {len(report.cycles)}")
    lines += [f"  {' <-> '.join(c)}" for c in report.cycles]
    if order is None:
        lines.append("upward imports: no declared order (tests/test_layering.py)")
    else:
        lines.append(f"upward imports (order low to high: {' < '.join(order)}): {len(report.upward)}")
        for u in report.upward:
            where = "in a function" if u.edge.in_function else "module level"
            lines.append(
                f"  {u.edge.source}:{u.edge.line} -> {u.edge.target} ({u.source_room} -> {u.target_room}, {where})"
            )
        if report.unknown_rooms:
            lines.append(f"rooms missing from the order: {', '.join(report.unknown_rooms)}")
    lines.append(f"files over {MAX_LINES} lines: {len(report.long_files)}")
    lines += [f"  {path}: {n}" for path, n in report.long_files.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=str(REPO / "tokenflow_ray"), help="the package directory")
    parser.add_argument("--json", help="also write the report as JSON to this path")
    args = parser.parse_args(argv)
    order = declared_order()
    report = analyse(Path(args.root), order)
    print(format_report(report, order))
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(report), indent=1) + "\n")
    clean = not (report.cycles or report.upward or report.unknown_rooms or report.long_files)
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())

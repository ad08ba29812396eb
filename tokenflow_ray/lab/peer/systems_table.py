"""One row per system of a `tokenflow bench peer` report: the table both workloads print (burst and conversations)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

Column = tuple[str, str, str]  # (header, the summary's key, format spec)


def systems_table(title: str, columns: Sequence[Column], systems: Mapping[str, Mapping[str, Any]],
                  done: Callable[[Mapping[str, Any]], str]) -> str:
    """The table as text; a system that failed reads "error", a missing figure "-"."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for header in ("system", *(c[0] for c in columns), "done"):
        table.add_column(header, justify="left" if header == "system" else "right")
    for name, p in systems.items():
        if "error" in p:
            table.add_row(name, "error", *[""] * len(columns))
            continue
        table.add_row(name, *("-" if p.get(key) is None else format(p[key], spec) for _, key, spec in columns),
                      done(p))
    console = Console(record=True)
    console.print(table)
    return console.export_text()

"""Where migrated streams go, and which to move: pure decisions over the central table and replica stats.

Pure Python (no ray, no torch): the central actor (serve/central.py) and the simulator call the same functions.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def choose_target(summary: Mapping[str, Mapping[str, float]], source: str, candidates: Iterable[str]) -> str | None:
    """The candidate (not the source) with the least declared rate, then the fewest streams; ties by id, so the
    choice is deterministic. None when there is no other candidate."""
    others = sorted(c for c in candidates if c != source)
    if not others:
        return None

    def load(rid: str) -> tuple[float, float, str]:
        row = summary.get(rid, {})
        return (row.get("sum_rate", 0.0), row.get("streams", 0), rid)

    return min(others, key=load)

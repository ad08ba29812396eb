"""Time source: wall time in the engine, virtual time in tests and the simulator."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...


class WallClock:
    def now(self) -> float:
        return time.monotonic()


class VirtualClock:
    """Advanced explicitly; never goes backwards."""

    def __init__(self, start: float = 0.0) -> None:
        self._t = start

    def now(self) -> float:
        return self._t

    def advance(self, dt: float) -> float:
        if dt < 0:
            raise ValueError("VirtualClock: cannot go backwards")
        self._t += dt
        return self._t

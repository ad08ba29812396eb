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

    def advance_to(self, t: float) -> float:
        """Jump to time t (the simulator's next event); t before now is an error, t == now a no-op."""
        if t < self._t:
            raise ValueError(f"VirtualClock: cannot go backwards ({t} < {self._t})")
        self._t = t
        return self._t

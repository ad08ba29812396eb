"""Input checks shared by every config and by the reader model, stream records and workloads (pure Python)."""

from __future__ import annotations

import math


def require(ok: bool, message: str) -> None:
    """A config's validation step (in `__post_init__`): the message, as a ValueError, when `ok` is false."""
    if not ok:
        raise ValueError(message)


def check_rate(value: object, field: str = "rate") -> float:
    """A consumption rate in tokens/s: a finite real >= 0 (0 = unpaced). Returns it as float."""
    # bool is an int subclass; a rate of True is a bug upstream, not 1 tok/s.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{field} must be a number >= 0, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{field} must be finite and >= 0, got {value!r}")
    return float(value)


def check_time(value: object, field: str = "t") -> float:
    """A timestamp in seconds: a finite real (any sign; clocks may start anywhere)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{field} must be a finite number of seconds, got {value!r}")
    return float(value)


def check_count(value: object, field: str, minimum: int = 0) -> int:
    """A token or event count: an int >= minimum (bools rejected)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{field} must be an int >= {minimum}, got {value!r}")
    return value


def check_positive(value: object, field: str) -> float:
    """A finite real > 0 (scales, arrival rates, shapes)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{field} must be a number > 0, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{field} must be finite and > 0, got {value!r}")
    return float(value)

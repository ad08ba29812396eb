"""Scheduling policies: one ABC, one class per policy, selected by name.

A policy only *orders*: which running streams keep the GPU first, which waiting streams are admitted first, and
which running stream gives its blocks up when memory runs out. The scheduler owns the mechanics and the accounting,
so every policy gets the same invariants for free.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from tokenflow_ray.engine.stream import Stream


class SchedulingPolicy(ABC):
    name: str

    @abstractmethod
    def order_running(self, running: Sequence[Stream], now: float) -> list[Stream]:
        """Running streams, most deserving of this step's token budget first."""

    @abstractmethod
    def order_waiting(self, waiting: Sequence[Stream], now: float) -> list[Stream]:
        """Waiting streams in admission order."""

    @abstractmethod
    def choose_victim(self, candidates: Sequence[Stream], now: float) -> Stream:
        """The running stream to preempt when memory runs out (candidates is never empty)."""


class FCFSPolicy(SchedulingPolicy):
    """Arrival order; preempts the newest stream only when memory forces it (vLLM/SGLang behaviour)."""

    name = "fcfs"

    def order_running(self, running: Sequence[Stream], now: float) -> list[Stream]:
        return sorted(running, key=_arrival_key)

    def order_waiting(self, waiting: Sequence[Stream], now: float) -> list[Stream]:
        return sorted(waiting, key=_arrival_key)

    def choose_victim(self, candidates: Sequence[Stream], now: float) -> Stream:
        return max(candidates, key=_arrival_key)


def _arrival_key(s: Stream) -> tuple[float, str]:
    return (s.arrival_time, s.stream_id)


_POLICIES: dict[str, type[SchedulingPolicy]] = {"fcfs": FCFSPolicy}


def make_policy(name: str) -> SchedulingPolicy:
    try:
        return _POLICIES[name]()
    except KeyError:
        raise ValueError(f"policy: unknown policy {name!r}; choose one of {sorted(_POLICIES)}") from None

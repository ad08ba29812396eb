"""FCFS, prefill-first and non-preemptive: the paper's SGLang/vLLM baseline.

Arrival order for everything; a stream loses its blocks only when memory forces it, newest first, and then
recomputes (no host store, as in the baseline systems). Admission is memory-aware as in SGLang: a new stream is
admitted only if, after its prompt, `reserve_ratio` of every running stream's remaining max_tokens still fits
(SGLang's new_token_ratio starts at 0.7 and decays to 0.1; 0.3 sits between; 0 is vLLM v1's greedy admission).
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenflow_ray.engine.policies.base import SchedulerView, SchedulingPolicy, arrival_key
from tokenflow_ray.engine.stream import Stream


class FCFSPolicy(SchedulingPolicy):
    name = "fcfs"

    def __init__(self, reserve_ratio: float = 0.3) -> None:
        if not 0.0 <= reserve_ratio <= 1.0:
            raise ValueError(f"fcfs.reserve_ratio: must be in [0, 1], got {reserve_ratio!r}")
        self.reserve_ratio = reserve_ratio

    def reserve_tokens(self, running: Sequence[Stream]) -> int:
        return int(self.reserve_ratio * sum(s.sampling.max_tokens - s.num_output_tokens for s in running))

    def rank(self, streams: Sequence[Stream], view: SchedulerView) -> list[Stream]:
        return sorted(streams, key=arrival_key)

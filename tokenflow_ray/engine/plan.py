"""The data contract between scheduler and model runner: one StepPlan in, one StepResult back.

Only plain frozen dataclasses, so a plan can cross a process or actor boundary unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenflow_ray.engine.sampling import SamplingParams


@dataclass(frozen=True)
class ScheduledChunk:
    """Feed token_ids at positions [start_pos, start_pos + len) of one stream, writing their KV into block_ids."""

    stream_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    block_ids: tuple[int, ...]  # the stream's whole device block table after this step's allocation
    sample: bool  # the chunk reaches the stream's last token, so a next token is sampled


@dataclass(frozen=True)
class StepPlan:
    step_id: int
    decodes: tuple[ScheduledChunk, ...] = ()  # one token each
    prefills: tuple[ScheduledChunk, ...] = ()  # prompt (or recompute) chunks
    preempted: tuple[str, ...] = ()  # streams whose device blocks were freed this step (KV to be recomputed)
    finished: tuple[str, ...] = ()  # streams that ended since the last plan: the runner drops their state
    new_streams: tuple[tuple[str, SamplingParams], ...] = ()  # first time scheduled: sent once, kept by the runner

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(len(c.token_ids) for c in self.prefills)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


@dataclass(frozen=True)
class StepResult:
    step_id: int
    sampled: dict[str, int] = field(default_factory=dict)  # stream id -> next token, for chunks with sample=True
    compute_s: float = 0.0

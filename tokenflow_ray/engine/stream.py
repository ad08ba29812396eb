"""Per-stream state: a few counters plus the token lists; everything else is derived by properties."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tokenflow_ray.engine.sampling import SamplingParams
from tokenflow_ray.metrics.reader import ReaderModel
from tokenflow_ray.metrics.stream_metrics import StreamRecord


class StreamStatus(enum.IntEnum):
    """Ordered: everything at or above FINISHED_STOPPED is terminal."""

    WAITING = 0  # needs its KV (re)computed from scratch: new, or preempted by recompute
    PREEMPTED = 1  # paused with (part of) its KV in the host spill store; resumes by load or recompute
    LOADING = 2  # host -> device load in flight this step; runs from the next step
    RUNNING = 3  # owns device blocks
    FINISHED_STOPPED = 4  # eos, a stop token or a stop string
    FINISHED_LENGTH = 5  # max_tokens or the context limit
    FINISHED_ABORTED = 6  # cancelled by the client or rejected

    @property
    def finished(self) -> bool:
        return self >= StreamStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


# Built once, not per call (the engine asks every stream's status for it every step).
_FINISH_REASONS = {StreamStatus.FINISHED_STOPPED: "stop", StreamStatus.FINISHED_LENGTH: "length",
                   StreamStatus.FINISHED_ABORTED: "abort"}


@dataclass(eq=False)
class Stream:
    stream_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    arrival_time: float
    max_total_tokens: int  # context limit for this stream: min(model context, KV pool capacity)
    eos_token_ids: frozenset[int] = frozenset()
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the device cache
    block_ids: list[int] = field(default_factory=list)  # device blocks, in order
    host_block_ids: list[int] = field(default_factory=list)  # host spill blocks; host block i mirrors block i
    num_host_tokens: int = 0  # tokens whose KV is valid in the host store (a prefix of the stream)
    status: StreamStatus = StreamStatus.WAITING
    last_preempted_at: float = float("-inf")
    rate: float = 0.0  # declared consumption rate, tokens/s (0: unpaced reader)
    # Prefix caching (block_pool.py): the content keys of the stream's full blocks known so far, how many of its
    # device blocks were offered to the cache, and its prompt tokens the cache served at its first start.
    block_keys: list[int] = field(default_factory=list)
    num_keyed_blocks: int = 0
    num_cached_tokens: int = 0
    num_dropped_tokens: int = 0  # KV tokens its last preemption by recompute dropped (recorded as recomputed)
    reader: ReaderModel = field(init=False)  # the server's model of the client's buffer
    record: StreamRecord = field(init=False)  # metrics: token times and buffers, preemptions
    # What ends the stream, fixed at creation and checked for every token it generates: the token ids that
    # stop it (eos unless ignored, and its stop tokens), and its output length limit (max_tokens or the context
    # limit).
    stop_token_set: frozenset[int] = field(init=False, repr=False)
    max_output_tokens: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt: must contain at least one token")
        if len(self.prompt_token_ids) >= self.max_total_tokens:
            raise ValueError(f"prompt: {len(self.prompt_token_ids)} tokens leaves no room to generate within the "
                             f"context limit of {self.max_total_tokens} tokens")
        self.reader = ReaderModel(self.rate)  # validates the rate
        sp = self.sampling
        self.stop_token_set = frozenset(sp.stop_token_ids).union(() if sp.ignore_eos else self.eos_token_ids)
        self.max_output_tokens = min(sp.max_tokens, self.max_total_tokens - len(self.prompt_token_ids))
        self.record = StreamRecord(self.stream_id, self.arrival_time, self.rate, len(self.prompt_token_ids))

    # Counters live in the reader and the metrics record; these views keep one copy of each.
    @property
    def first_token_time(self) -> float | None:
        return self.reader.first_token_time

    @property
    def num_preemptions(self) -> int:
        return self.record.preemptions

    @property
    def num_recomputed_tokens(self) -> int:
        """Tokens whose KV was computed again after a preemption."""
        return self.record.tokens_recomputed

    def buffer_s(self, now: float) -> float:
        """Seconds of reading the client has buffered (0 for unpaced readers and before the first token)."""
        return self.reader.buffer_seconds_at(now)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def token_ids(self, start: int, end: int) -> tuple[int, ...]:
        """Tokens [start, end) of prompt + output, without building the whole list."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return tuple(self.output_token_ids[start - p:end - p])
        return self.prompt_token_ids[start:] + tuple(self.output_token_ids[:end - p])

    def stop_reason_after_append(self, token_id: int) -> StreamStatus | None:
        """The terminal status reached by having just appended token_id, if any (stop strings are the engine's)."""
        if token_id in self.stop_token_set:  # eos (unless ignored) or a stop token
            return StreamStatus.FINISHED_STOPPED
        if len(self.output_token_ids) >= self.max_output_tokens:  # max_tokens or the context limit
            return StreamStatus.FINISHED_LENGTH
        return None

"""What the engine hands back per stream per step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class StreamOutput(NamedTuple):
    """One per stream per step: a NamedTuple (immutable, picklable), as a frozen dataclass's __init__ cost 4x as
    much on the engine's per-token path."""

    stream_id: str
    token_ids: tuple[int, ...]  # new this step
    text: str  # new text this step (may be empty while a character or a possible stop string is incomplete)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    num_prompt_tokens: int
    num_output_tokens: int  # cumulative
    num_cached_tokens: int = 0  # prompt tokens prefix caching served (OpenAI's usage.prompt_tokens_details)


@dataclass(frozen=True)
class GenerationResult:
    stream_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for routing, autoscaling and metrics."""

    num_running: int
    num_waiting: int
    num_preempted: int  # paused with KV on the host, or loading back
    device_blocks_total: int
    device_blocks_free: int
    host_blocks_total: int
    host_blocks_free: int
    bytes_to_host: int
    bytes_from_host: int
    min_buffer_s: float  # smallest buffered reading time among running paced streams: how urgent the replica is
    sum_rate: float  # Σ declared rates of live streams (tokens/s)
    preemptions: int
    tokens_recomputed: int
    streams_finished: int
    steps: int
    # Prefix caching (engine/prefix_cache.py): blocks holding a findable prefix, and tokens looked up and found by
    # every start from nothing on the device (first starts and resumes), and by prompts (their first starts).
    device_blocks_cached: int = 0
    prefix_lookup_tokens: int = 0
    prefix_hit_tokens_device: int = 0
    prompt_tokens_total: int = 0
    prompt_cached_tokens_total: int = 0

    @property
    def prefix_hit_rate_device(self) -> float:
        return self.prefix_hit_tokens_device / self.prefix_lookup_tokens if self.prefix_lookup_tokens else 0.0

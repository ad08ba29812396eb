"""What a paused stream carries from one engine to another (live migration between replicas).

A stream leaves its engine between steps, paused, with its KV in the host spill store (or none, when it was
paused by recompute or never ran): the host blocks' data, its tokens, sampling parameters and the sampler's
generator state, the reader model, the detokenizer and stop-string state, and its metrics record. The importing
engine puts the KV in its own host store and resumes the stream by load (or recompute) like any paused stream, so
the output continues token for token as if the stream had never moved.

Times are carried relative to the moment of export: engines' clocks (monotonic, per process) have different
origins, so the importer shifts every stored time onto its own clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenflow_ray.engine.sampling import SamplingParams
from tokenflow_ray.metrics.reader import ReaderModel
from tokenflow_ray.metrics.stream_metrics import StreamRecord


class StreamNotExportable(LookupError):
    """The stream is unknown, finished, or cannot leave now (it is loading, or a copy of its KV is in flight)."""


@dataclass(frozen=True)
class ExportedStream:
    stream_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    sampling: SamplingParams
    rate: float
    block_size: int
    num_kv_tokens: int  # tokens whose KV is in `kv` (a prefix of the stream); 0: the importer recomputes
    kv: Any  # the runner's block data for those tokens (numpy for the torch runner), None when num_kv_tokens == 0
    sampler_state: Any  # the stream's generator state (seeded sampling), None when it has none
    text_state: tuple | None  # (detokenizer state, stop matcher's pending text); None without a tokenizer
    reader: ReaderModel  # the server's model of the client's buffer, on the exporter's clock
    record: StreamRecord  # token times, preemptions, recomputes so far, on the exporter's clock
    arrival_time: float
    last_preempted_at: float
    exported_at: float  # the exporter's clock at export: the origin the importer shifts from

    def __post_init__(self) -> None:
        if (self.kv is None) != (self.num_kv_tokens == 0):
            raise ValueError("ExportedStream: kv data must come with num_kv_tokens > 0, and only then")
        if self.num_kv_tokens > len(self.prompt_token_ids) + len(self.output_token_ids):
            raise ValueError("ExportedStream: more KV tokens than the stream has")

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

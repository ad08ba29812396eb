"""Stream accounting and metrics (pure Python: no torch, no ray). Definitions: docs/design.md §6."""

from __future__ import annotations

from tokenflow_ray.metrics.reader import ReaderModel
from tokenflow_ray.metrics.stream_metrics import (
    BufferSample,
    StreamRecord,
    buffer_timeline,
    effective_tokens,
    effective_weight,
    stream_qoe,
    stream_stall_s,
)
from tokenflow_ray.metrics.summary import PolicySummary, summarize

__all__ = [
    "BufferSample",
    "PolicySummary",
    "ReaderModel",
    "StreamRecord",
    "buffer_timeline",
    "effective_tokens",
    "effective_weight",
    "stream_qoe",
    "stream_stall_s",
    "summarize",
]

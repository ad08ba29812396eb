"""Per-stream record and per-stream metric definitions (TTFT, TBT, effective-throughput weight, stall, QoE).

One definition, used by the engine, the simulator, the benchmarks and Prometheus (docs/design.md §6).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tokenflow_ray.checks import check_count, check_rate, check_time
from tokenflow_ray.metrics.reader import ReaderModel

_INF = math.inf


@dataclass(frozen=True)
class BufferSample:
    t: float
    buffer: float  # tokens buffered at the client when a token was generated (before it was added)


@dataclass
class StreamRecord:
    """What happened to one stream, built incrementally while it runs.

    Convention: `record_token(t, reader.buffer_at(t))` is called *before* `reader.on_tokens(t)`, so the buffer
    stored with token j is the paper's B_{i,j}: what the reader still had unread when token j was generated.
    """

    stream_id: str
    arrival_s: float  # submission time (TTFT starts here)
    rate: float  # declared consumption rate, tokens/s (0 = unpaced)
    prompt_len: int
    token_times: list[float] = field(default_factory=list)
    token_buffers: list[float] = field(default_factory=list)
    preemptions: int = 0
    tokens_recomputed: int = 0
    migrations: int = 0  # moves to another replica
    finished: bool = False
    # Stall seconds from the live ReaderModel (which saw client reports). None: replay the declared rate.
    stall_s: float | None = None

    def __post_init__(self) -> None:
        self.arrival_s = check_time(self.arrival_s, "arrival_s")
        self.rate = check_rate(self.rate)
        check_count(self.prompt_len, "prompt_len")
        check_count(self.preemptions, "preemptions")
        check_count(self.tokens_recomputed, "tokens_recomputed")
        if len(self.token_times) != len(self.token_buffers):
            raise ValueError("token_times and token_buffers must have the same length")

    def record_token(self, t: float, buffer: float) -> None:
        """One output token emitted at t while the client had `buffer` tokens unread."""
        times = self.token_times
        # The engine's case, once per token: a float time not before the last (so finite) and an int buffer.
        if type(t) is float and (times[-1] if times else self.arrival_s) <= t < _INF and type(buffer) is int \
                and buffer >= 0 and not self.finished:
            times.append(t)
            self.token_buffers.append(float(buffer))
            return
        t = check_time(t)
        if self.finished:
            raise ValueError(f"stream {self.stream_id}: record_token after finish")
        last = self.token_times[-1] if self.token_times else self.arrival_s
        if t < last:
            raise ValueError(f"stream {self.stream_id}: token time {t} is before {last}")
        if isinstance(buffer, bool) or not isinstance(buffer, (int, float)) or not buffer >= 0:
            raise ValueError(f"buffer must be a number >= 0, got {buffer!r}")
        self.token_times.append(t)
        self.token_buffers.append(float(buffer))

    def record_preemption(self) -> None:
        self.preemptions += 1

    def record_recompute(self, tokens: int) -> None:
        self.tokens_recomputed += check_count(tokens, "tokens")

    def record_recompute_avoided(self, tokens: int) -> None:
        """Tokens recorded for recompute that prefix caching found still cached: not computed again after all."""
        self.tokens_recomputed -= min(check_count(tokens, "tokens"), self.tokens_recomputed)

    def mark_finished(self, stall_s: float | None = None) -> None:
        """The stream ended; pass the live reader's stall time if the engine has one."""
        if stall_s is not None:
            if isinstance(stall_s, bool) or not isinstance(stall_s, (int, float)) or not stall_s >= 0:
                raise ValueError(f"stall_s must be a number >= 0, got {stall_s!r}")
            self.stall_s = float(stall_s)
        self.finished = True

    def shifted(self, dt: float) -> None:
        """Move every stored time by dt (the record carried to another replica's clock)."""
        check_time(dt, "dt")
        self.arrival_s += dt
        self.token_times = [t + dt for t in self.token_times]

    def record_migration(self) -> None:
        self.migrations += 1

    # ---- derived ---------------------------------------------------------------------------------
    @property
    def output_len(self) -> int:
        return len(self.token_times)

    @property
    def ttft_s(self) -> float | None:
        """Submission -> first token; None if no token yet."""
        return self.token_times[0] - self.arrival_s if self.token_times else None

    @property
    def tbt_s(self) -> list[float]:
        """Gaps between consecutive tokens as emitted."""
        times = self.token_times
        return [b - a for a, b in zip(times, times[1:])]


def effective_weight(buffer: float, output_len: int) -> float:
    """Paper §7.1.3: 1 if B <= 0.1L, (0.2L - B)/(0.1L) if 0.1L < B <= 0.2L, 0 above 0.2L."""
    low, high = 0.1 * output_len, 0.2 * output_len
    if buffer <= low:
        return 1.0
    if buffer >= high:
        return 0.0
    return (high - buffer) / (high - low)


def effective_tokens(record: StreamRecord) -> float:
    """Sum of effective-throughput weights over the stream's tokens (L = tokens generated)."""
    length = record.output_len
    return sum(effective_weight(b, length) for b in record.token_buffers)


def stream_stall_s(record: StreamRecord) -> float:
    """Stall seconds: the engine's live value if recorded, else a replay of the declared rate (no reports)."""
    if record.stall_s is not None:
        return record.stall_s
    if not record.token_times:
        return 0.0
    reader = ReaderModel(record.rate)
    for t in record.token_times:
        reader.on_tokens(t)
    end = record.token_times[-1]
    if record.finished:
        reader.finish(end)
    return reader.stall_time_at(end)


def stream_qoe(record: StreamRecord, ttft_target_s: float = 1.0) -> float | None:
    """Andes QoE = 1 - S_delay / S_whole (Liu et al., arXiv 2404.16283, §3).

    Expected delivery: token j at e_j = arrival + ttft_target + j/rate. S_whole is the area under the
    expected cumulative-tokens curve up to T = max(last actual, last expected delivery). S_delay is the area
    where the actual curve lags the expected one; cutting both step curves horizontally at each token level
    shows it equals sum_j max(0, a_j - e_j). Tokens that arrive early earn nothing (the reader paces them).
    None for a stream with no tokens or an unpaced stream (no expected pace to compare with).
    """
    check_rate(ttft_target_s, "ttft_target_s")  # same rule: finite, >= 0
    if not record.token_times or record.rate == 0:
        return None
    start = record.arrival_s + ttft_target_s
    expected = [start + j / record.rate for j in range(record.output_len)]
    horizon = max(record.token_times[-1], expected[-1])
    s_whole = sum(horizon - e for e in expected)
    if s_whole <= 0:
        return 1.0  # one token, on time: nothing to lag behind
    s_delay = sum(max(0.0, a - e) for a, e in zip(record.token_times, expected))
    return 1.0 - s_delay / s_whole


def buffer_timeline(record: StreamRecord) -> list[BufferSample]:
    """(t, buffer) at each token's generation, as the scheduler saw it; for buffer-occupancy plots."""
    return [BufferSample(t, b) for t, b in zip(record.token_times, record.token_buffers)]

"""Production request traces as workloads: the one reader of every trace format the project replays.

Formats (../shared/data/traces/README.md), told apart by content or named with `format`:
- `azure`: the Azure LLM inference trace 2023, CSV `TIMESTAMP,ContextTokens,GeneratedTokens` (wall-clock times);
- `burstgpt`: BurstGPT, CSV `Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type` (seconds from
  the trace's start); failed rows (no response tokens) are skipped and counted, as vLLM's `burstgpt` loader does;
- `mooncake`: Mooncake JSONL, one object a line with `timestamp` (ms), `input_length`, `output_length`, `hash_ids`.

`TraceOptions` says which part to replay and how: `window` (start minute, minutes; counted from the trace's first
request), `speed` (every inter-arrival time divided by it), reader `rates` (no trace has them: drawn per stream
in exact proportions, seeded), `length_scale` (prompts and outputs x it, rounded, at least 1 token) and
`max_context` (prompt + output at most this: the prompt is cut first, as a server would truncate it). A bad file or
row is a `TraceError` whose message names the file and line. Pure Python, stdlib only.
"""

from __future__ import annotations

import csv
import json
import math
import random
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from tokenflow_ray.workloads.generators import RequestSpec, assign_rates

TRACE_FORMATS = ("azure", "burstgpt", "mooncake")
DEFAULT_RATES = ((15.0, 0.4), (20.0, 0.6))  # the paper's reader mix: 40% at 15 tok/s, 60% at 20
_AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_BURSTGPT_HEADER = ("Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type")


class TraceError(ValueError):
    """A trace that cannot be read; the message starts with `path:line:`."""


@dataclass(frozen=True)
class TraceRow:
    line: int  # 1-based line in the file, for messages
    time_s: float  # seconds on the trace's own clock (any origin)
    prompt_len: int
    output_len: int
    hash_ids: tuple[int, ...] = ()  # Mooncake: one id per 512 prompt tokens; equal ids are equal blocks


@dataclass(frozen=True)
class TraceOptions:
    window: tuple[float, float] | None = None  # (start minute, minutes); None: the whole trace
    speed: float = 1.0
    rates: tuple[tuple[float, float], ...] = DEFAULT_RATES  # (rate tok/s, fraction)
    length_scale: float = 1.0
    max_context: int | None = None
    seed: int = 0
    format: str | None = None  # None: told by content

    def __post_init__(self) -> None:
        if self.window is not None:
            start, minutes = self.window
            if not (math.isfinite(start) and start >= 0 and math.isfinite(minutes) and minutes > 0):
                raise ValueError(f"window: expected START_MIN >= 0 and MINUTES > 0, got {self.window}")
        _check_positive(self.speed, "speed")
        _check_positive(self.length_scale, "length_scale")
        if not self.rates or abs(sum(f for _, f in self.rates) - 1.0) > 1e-6:
            raise ValueError(f"rates: fractions must sum to 1, got {self.rates}")
        for rate, fraction in self.rates:
            _check_positive(rate, "rates: rate")
            _check_positive(fraction, "rates: fraction")
        if self.max_context is not None and (not isinstance(self.max_context, int) or self.max_context < 2):
            raise ValueError(f"max_context: expected an integer >= 2, got {self.max_context!r}")
        if self.format is not None and self.format not in TRACE_FORMATS:
            raise ValueError(f"trace format: expected one of {', '.join(TRACE_FORMATS)}, got {self.format!r}")


def _check_positive(value: float, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
        raise ValueError(f"{name}: expected a positive number, got {value!r}")


def parse_window(text: str) -> tuple[float, float]:
    """`START_MIN:MINUTES`, e.g. `0:10` for the first ten minutes."""
    start, sep, minutes = text.partition(":")
    try:
        window = (float(start), float(minutes))
    except ValueError:
        window = None
    if not sep or window is None or not (window[0] >= 0 and window[1] > 0):
        raise ValueError(f"--window: expected START_MIN:MINUTES like 0:10, got {text!r}")
    return window


def parse_rates(text: str) -> tuple[tuple[float, float], ...]:
    """`RATE:FRACTION,...`, e.g. `15:0.4,20:0.6`; a single `RATE` means every reader at that rate."""
    items = [i.strip() for i in text.split(",") if i.strip()]
    try:
        pairs = tuple((float(r), float(f or 1.0)) for r, _, f in (i.partition(":") for i in items))
    except ValueError:
        pairs = ()
    if not pairs or abs(sum(f for _, f in pairs) - 1.0) > 1e-6 or any(r <= 0 or f <= 0 for r, f in pairs):
        raise ValueError(f"--rates: expected RATE:FRACTION,... with fractions summing to 1 like 15:0.4,20:0.6, "
                         f"got {text!r}")
    return pairs


def detect_format(path: Path) -> str:
    with _open(path) as f:
        first = f.readline().strip()
    if first.startswith("{"):
        return "mooncake"
    header = tuple(c.strip() for c in first.split(","))
    if header[:3] == _AZURE_HEADER:
        return "azure"
    if header[:4] == _BURSTGPT_HEADER[:4]:
        return "burstgpt"
    raise TraceError(f"{path}:1: not a known trace format (Azure CSV {','.join(_AZURE_HEADER)}, BurstGPT CSV "
                     f"{','.join(_BURSTGPT_HEADER)}, or Mooncake JSONL); name one with --trace-format")


def _open(path: Path):
    try:
        return path.open(newline="", encoding="utf-8")
    except FileNotFoundError:
        raise TraceError(f"{path}: no such trace file") from None
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc.strerror or exc}") from None


def read_trace(path: str | Path, format: str | None = None) -> tuple[str, list[TraceRow], int]:
    """(format, rows in file order, rows skipped as failed). Every row must parse; the first that does not is a
    TraceError naming its line."""
    path = Path(path)
    fmt = format or detect_format(path)
    if fmt not in TRACE_FORMATS:
        raise ValueError(f"trace format: expected one of {', '.join(TRACE_FORMATS)}, got {fmt!r}")
    reader = {"azure": _azure_rows, "burstgpt": _burstgpt_rows, "mooncake": _mooncake_rows}[fmt]
    rows, skipped = [], 0
    try:
        with _open(path) as f:
            for row in reader(path, f):
                if row is None:
                    skipped += 1
                else:
                    rows.append(row)
    except UnicodeDecodeError:
        raise TraceError(f"{path}: not a text file") from None
    if not rows:
        raise TraceError(f"{path}: no requests in the trace")
    return fmt, rows, skipped


def _count(path: Path, line: int, raw: str, name: str, minimum: int) -> int:
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value) or value != int(value) or value < minimum:
        raise TraceError(f"{path}:{line}: {name}: expected an integer >= {minimum}, got {raw!r}")
    return int(value)


def _seconds(path: Path, line: int, raw: str, name: str) -> float:
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise TraceError(f"{path}:{line}: {name}: expected a time >= 0, got {raw!r}")
    return value


def _csv_rows(path: Path, f, header: tuple[str, ...]):
    rows = csv.reader(f)
    first = next(rows, None)
    if first is None or tuple(c.strip() for c in first[: len(header)]) != header:
        raise TraceError(f"{path}:1: expected the header {','.join(header)}, got {','.join(first or [])!r}")
    for line, cells in enumerate(rows, start=2):
        if not cells or all(not c.strip() for c in cells):
            continue  # a blank line (a trailing newline) is not a request
        if len(cells) < len(header):
            raise TraceError(f"{path}:{line}: expected {len(header)} columns ({','.join(header)}), got {len(cells)}")
        yield line, [c.strip() for c in cells]


def _azure_rows(path: Path, f):
    for line, (stamp, context, generated, *_) in _csv_rows(path, f, _AZURE_HEADER):
        yield TraceRow(line, _wall_clock(path, line, stamp), _count(path, line, context, "ContextTokens", 1),
                       # An answer of 0 tokens still streams its end: one token to the engine.
                       max(1, _count(path, line, generated, "GeneratedTokens", 0)))


def _wall_clock(path: Path, line: int, stamp: str) -> float:
    """Seconds since the epoch from `2023-11-16 18:15:46.6805900`: seven fractional digits, which
    datetime.fromisoformat would cut to six, so the fraction is read apart."""
    whole, _, fraction = stamp.partition(".")
    try:
        seconds = datetime.fromisoformat(whole).timestamp()
        return seconds + (float(f"0.{fraction}") if fraction else 0.0)
    except ValueError:
        raise TraceError(f"{path}:{line}: TIMESTAMP: expected YYYY-MM-DD HH:MM:SS[.fraction], got {stamp!r}") from None


def _burstgpt_rows(path: Path, f):
    for line, (stamp, _model, request, response, *_) in _csv_rows(path, f, _BURSTGPT_HEADER):
        time_s = _seconds(path, line, stamp, "Timestamp")
        prompt = _count(path, line, request, "Request tokens", 0)
        output = _count(path, line, response, "Response tokens", 0)
        yield None if output == 0 or prompt == 0 else TraceRow(line, time_s, prompt, output)


def _mooncake_rows(path: Path, f):
    for line, text in enumerate(f, start=1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{path}:{line}: not a JSON object: {exc.msg}") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{path}:{line}: expected a JSON object, got {type(obj).__name__}")
        missing = [k for k in ("timestamp", "input_length", "output_length") if k not in obj]
        if missing:
            raise TraceError(f"{path}:{line}: missing {', '.join(missing)}")
        hash_ids = obj.get("hash_ids", [])
        if not isinstance(hash_ids, list) or not all(isinstance(h, int) and not isinstance(h, bool)
                                                     for h in hash_ids):
            raise TraceError(f"{path}:{line}: hash_ids: expected a list of integers")
        yield TraceRow(line, _seconds(path, line, str(obj["timestamp"]), "timestamp") / 1000.0,
                       _count(path, line, str(obj["input_length"]), "input_length", 1),
                       max(1, _count(path, line, str(obj["output_length"]), "output_length", 0)), tuple(hash_ids))


@dataclass(frozen=True)
class Trace:
    path: str
    format: str
    options: TraceOptions
    requests: list[RequestSpec]
    hash_ids: list[tuple[int, ...]]  # per request, in request order (Mooncake; empty tuples otherwise)
    rows_read: int
    rows_failed: int  # skipped as failed requests (BurstGPT)
    truncated: int  # requests cut to max_context

    def describe(self) -> dict:
        r, o = self.requests, self.options
        span = r[-1].arrival_s if len(r) > 1 else 0.0
        return {"trace": self.path, "format": self.format, "window": list(o.window) if o.window else None,
                "speed": o.speed, "rates": [list(p) for p in o.rates], "length_scale": o.length_scale,
                "max_context": o.max_context, "seed": o.seed, "num_requests": len(r), "rows_read": self.rows_read,
                "rows_failed": self.rows_failed, "truncated": self.truncated, "span_s": span,
                "requests_per_s": (len(r) - 1) / span if span > 0 else None,
                "mean_prompt": sum(q.prompt_len for q in r) / len(r),
                "mean_output": sum(q.output_len for q in r) / len(r),
                "sum_rate": sum(q.rate for q in r)}


def load_trace(path: str | Path, options: TraceOptions = TraceOptions()) -> Trace:
    """The trace's requests under `options`, sorted by arrival (ties in file order), the first at 0 s."""
    fmt, rows, failed = read_trace(path, options.format)
    rows = sorted(rows, key=lambda r: (r.time_s, r.line))
    origin, end = rows[0].time_s, rows[-1].time_s
    if options.window is not None:
        start_min, minutes = options.window
        lo, hi = origin + 60.0 * start_min, origin + 60.0 * (start_min + minutes)
        rows = [r for r in rows if lo <= r.time_s < hi]
        if not rows:
            raise TraceError(f"{path}: no requests in --window {start_min:g}:{minutes:g} (the trace spans "
                             f"{(end - origin) / 60:.1f} min)")
    first = rows[0].time_s
    rates = assign_rates(len(rows), options.rates, random.Random(f"{options.seed}:rates"))
    requests, truncated = [], 0
    for index, (row, rate) in enumerate(zip(rows, rates)):
        prompt = max(1, round(row.prompt_len * options.length_scale))
        output = max(1, round(row.output_len * options.length_scale))
        if options.max_context is not None and prompt + output > options.max_context:
            truncated += 1
            output = min(output, options.max_context - 1)
            prompt = options.max_context - output
        requests.append(RequestSpec(index, (row.time_s - first) / options.speed, prompt, output, rate,
                                    row.hash_ids))
    return Trace(str(path), fmt, options, requests, [r.hash_ids for r in rows], len(rows) + failed, failed,
                 truncated)


def trace_requests(path: str | Path, options: TraceOptions = TraceOptions()) -> list[RequestSpec]:
    return load_trace(path, options).requests


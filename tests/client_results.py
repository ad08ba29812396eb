"""Client-side results built by hand, for code that only reads them (plots, summaries)."""

from __future__ import annotations

from tokenflow_ray.client import LoadResult, StreamResult, StreamSpec
from tokenflow_ray.metrics.stream_metrics import StreamRecord


def fake_load_result(delay: float, streams: int = 4, tokens: int = 3, finished: bool = False) -> LoadResult:
    """Streams arriving 0.1 s apart whose first token comes `delay` after arrival, then one every 50 ms."""
    results = []
    for i in range(streams):
        rec = StreamRecord(f"s{i}", 0.1 * i, 20.0, 8)
        for j in range(tokens):
            rec.record_token(0.1 * i + delay + 0.05 * j, float(j))
        if finished:
            rec.mark_finished()
        results.append(StreamResult(StreamSpec("p", max_tokens=tokens, rate=20.0), f"s{i}", rec, num_tokens=tokens,
                                    finish_reason="length"))
    return LoadResult(results, 1.0)

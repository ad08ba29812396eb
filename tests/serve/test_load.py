"""Bounded loopback load: 256 concurrent paced streams, none lost or truncated."""

from __future__ import annotations

import asyncio

import pytest

from tokenflow_ray.client import StreamSpec, run_load

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]


def test_256_concurrent_paced_streams_complete(app):
    specs = [StreamSpec(f"stream {i}", max_tokens=8, rate=40.0, chat=i % 2 == 1) for i in range(256)]
    res = asyncio.run(run_load(app.base_url, specs, api_key=app.api_key, timeout_s=150, report_interval_s=0.5))
    errors = [r.error for r in res.results if r.error]
    assert not errors, errors[:3]
    assert res.num_complete == 256
    assert all(r.num_tokens == 8 and r.finish_reason == "length" for r in res.results)
    assert len({r.stream_id for r in res.results}) == 256
    print(f"256 streams: {res.total_tokens} tokens in {res.wall_s:.1f} s, "
          f"ttft p99 {res.summary().ttft_p99_s:.2f} s")
    kv = app.llm_handle().kv_usage.remote().result()
    assert kv["device_blocks_free"] == kv["device_blocks_total"]

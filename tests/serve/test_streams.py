"""Consumption reports reach the replica's scheduler; a disconnect frees device and host KV; /metrics serves."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]


def _wait_for(fn, timeout_s: float = 20.0, interval_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while True:
        value = fn()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)


def _open_stream(app, client: httpx.Client, max_tokens: int, rate: float):
    body = {"model": "embedded", "prompt": "Tell me a story", "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0, "consumption_rate": rate}
    return client.stream("POST", app.base_url + "/v1/completions", json=body, headers=app.headers)


def _first_chunk(lines) -> dict:
    # Keep one line iterator per response: a dropped httpx iterator closes the connection (a disconnect).
    for line in lines:
        if line.startswith("data: "):
            return json.loads(line[6:])
    raise AssertionError("no chunk")


def test_pause_and_rate_reports_change_the_replica_stream(app):
    llm = app.llm_handle()
    with httpx.Client(timeout=60) as client, _open_stream(app, client, max_tokens=400, rate=5) as resp:
        lines = resp.iter_lines()
        sid = _first_chunk(lines)["id"]
        state = llm.stream_state.remote(sid).result()
        assert state["rate"] == 5 and state["paused"] is False
        url = f"{app.base_url}/v1/streams/{sid}/consumption"
        assert client.post(url, json={"paused": True}, headers=app.headers).status_code == 204
        assert _wait_for(lambda: (llm.stream_state.remote(sid).result() or {}).get("paused") is True)
        r = client.post(url, json={"paused": False, "rate": 2.5, "consumed_tokens": 1}, headers=app.headers)
        assert r.status_code == 204
        st = _wait_for(lambda: (s := llm.stream_state.remote(sid).result()) and s["rate"] == 2.5 and s)
        assert st["paused"] is False and st["rate"] == 2.5
        nan = client.post(url, content=b'{"rate": NaN}', headers={**app.headers, "content-type": "application/json"})
        assert nan.status_code == 400 and nan.json()["error"]["param"] == "rate"
    # The stream is gone once the client left: reports for it are 404.
    gone = _wait_for(lambda: httpx.post(url, json={"rate": 1.0}, headers=app.headers).status_code == 404)
    assert gone


def test_disconnect_mid_stream_frees_device_and_host_kv(app):
    llm = app.llm_handle()
    with httpx.Client(timeout=60) as client, _open_stream(app, client, max_tokens=1500, rate=0) as resp:
        lines = resp.iter_lines()
        sid = _first_chunk(lines)["id"]
        assert _wait_for(lambda: (llm.stream_state.remote(sid).result() or {}).get("num_device_blocks", 0) > 0)
    # Leaving the `with` closed the connection mid-stream.
    assert _wait_for(lambda: llm.stream_state.remote(sid).result() is None)
    usage = _wait_for(lambda: (u := llm.kv_usage.remote().result())["device_blocks_free"]
                      == u["device_blocks_total"] and u)
    assert usage["device_blocks_free"] == usage["device_blocks_total"]
    assert usage.get("host_blocks_free") == usage.get("host_blocks_total") == 64
    assert llm.check_integrity.remote().result() is True


def test_metrics_endpoint_renders_replica_stats(app):
    from tokenflow_ray.client import StreamSpec, run_load

    res = asyncio.run(run_load(app.base_url, [StreamSpec("metrics", max_tokens=6, rate=50)] * 3,
                               api_key=app.api_key, timeout_s=60))
    assert res.num_complete == 3

    def scraped() -> str | None:
        text = httpx.get(app.base_url + "/metrics").text
        counts = [float(line.split()[-1]) for line in text.splitlines()
                  if line.startswith("tokenflow_ttft_seconds_count")]
        return text if counts and sum(counts) >= 3 else None

    text = _wait_for(scraped, timeout_s=15)
    assert text, "ttft histogram never showed the finished streams"
    for name in ("tokenflow_tbt_seconds_bucket", "tokenflow_tokens_total", "tokenflow_effective_tokens_total",
                 "tokenflow_preemptions", "tokenflow_bytes_to_host", "tokenflow_buffer_tokens_mean",
                 "tokenflow_stall_seconds_bucket", "tokenflow_qoe_bucket"):
        assert name in text, name
    # What readers feel: one QoE and one stall figure per finished paced stream.
    qoe = sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("tokenflow_qoe_count"))
    stalls = sum(float(line.split()[-1]) for line in text.splitlines()
                 if line.startswith("tokenflow_stall_seconds_count"))
    assert qoe >= 3 and stalls >= 3

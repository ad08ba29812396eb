"""Over real HTTP: the replica's engine holds more streams than its batch; past Serve's bounded queue, 429s."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tokenflow_ray.client import StreamSpec, run_load

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

APP = "tfadmit"
RETRY_AFTER_S = 3


@pytest.fixture(scope="module")
def admit_app(serve_url):
    from tokenflow_ray.serve.app import deploy, undeploy
    from tokenflow_ray.serve.config import ServeConfig, serve_engine

    # A batch of 2; (96 + 32 blocks) / (256 tokens / 16) = 8 streams per replica (derived); 2 more queued: a
    # budget of (8 + 2) x 16 = 160 blocks that each stream claims its prompt + max_tokens of.
    config = ServeConfig(app_name=APP, route_prefix=f"/{APP}", expected_stream_tokens=256,
                         max_queued_requests=2, retry_after_s=RETRY_AFTER_S, images=False, num_cpus=1,
                         engine=serve_engine(policy="fcfs", max_num_seqs=2, num_device_blocks=96, num_host_blocks=32))
    assert (config.admission().max_ongoing_requests, config.admission().max_queued_requests) == (8, 2)
    deploy(config)
    try:
        yield f"{serve_url}/{APP}"
    finally:
        undeploy(config)


def _body(i: int, max_tokens: int, stream: bool) -> dict:
    return {"model": "embedded", "prompt": f"Story {i}:", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": stream, "stream_options": {"include_usage": True} if stream else None}


async def _request(http: httpx.AsyncClient, url: str, i: int, max_tokens: int, stream: bool) -> dict:
    body = {k: v for k, v in _body(i, max_tokens, stream).items() if v is not None}
    async with http.stream("POST", url + "/v1/completions", json=body) as resp:
        raw = (await resp.aread()).decode()
    return {"status": resp.status_code, "headers": resp.headers, "raw": raw, "stream": stream,
            "max_tokens": max_tokens}


def _check(r: dict) -> None:
    """Every answer is a complete 200 or an OpenAI-shaped 429 with Retry-After; never a 500."""
    if r["status"] == 429:
        err = json.loads(r["raw"])["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == "queue_full", err
        assert err["type"] == "rate_limit_error" and err["message"]
        assert r["headers"]["retry-after"] == str(RETRY_AFTER_S)
        return
    assert r["status"] == 200, r
    if r["stream"]:
        events = [line[6:] for line in r["raw"].splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), events[-3:]
        assert json.loads(events[-2])["usage"]["completion_tokens"] == r["max_tokens"]
    else:
        assert json.loads(r["raw"])["usage"]["completion_tokens"] == r["max_tokens"]


def test_replica_engine_holds_more_live_streams_than_its_batch(admit_app):
    from ray import serve

    llm = serve.get_deployment_handle("LLMServer", APP)
    # Arrivals 50 ms apart: Serve counts a request as queued while its router picks a replica, so simultaneous
    # arrivals can be refused by a queue bound of 2 even with free slots (tokenflow_ray/serve/replica/admission.py).
    specs = [StreamSpec(f"paced {i}", max_tokens=300, rate=20.0, start_s=0.05 * i) for i in range(6)]

    async def run():
        load = asyncio.create_task(run_load(admit_app, specs, timeout_s=120, report_interval_s=0.5))
        peak, peak_running = 0, 0
        while not load.done():
            # 6 streams + this call fit the replica's 8 slots.
            g = (await asyncio.to_thread(lambda: llm.stats.remote().result()))["gauges"]
            peak = max(peak, g["num_running"] + g["num_waiting"] + g["num_preempted"])
            peak_running = max(peak_running, g["num_running"])
            await asyncio.sleep(0.1)
        return peak, peak_running, await load

    peak, peak_running, res = asyncio.run(run())
    assert res.num_complete == 6, [r.error for r in res.results]
    assert peak > 2, f"the engine never held more than its batch of 2 (peak {peak})"
    assert peak_running <= 2


def test_past_the_bounded_queue_requests_get_429_and_the_rest_complete(admit_app):
    async def run():
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            # 12 long streams, 50 ms apart, each claiming (8 + 600) / 16 = 38 of the 160 blocks; then, while four of
            # them hold 152, a mixed probe of short streaming and non-streaming requests (2 blocks each).
            first = []
            for i in range(12):
                first.append(asyncio.create_task(_request(http, admit_app, i, 600, True)))
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)
            probes = [asyncio.create_task(_request(http, admit_app, 100 + i, 16, i % 2 == 0)) for i in range(8)]
            return await asyncio.gather(*first), await asyncio.gather(*probes)

    first, probes = asyncio.run(run())
    for r in first + probes:
        _check(r)
    assert any(r["status"] == 429 for r in first)
    assert sum(r["status"] == 200 for r in first) >= 4  # what the budget holds is never refused
    # Admission counts blocks, not streams: short probes still fit beside the long streams (3 of 2 blocks in the 8
    # left), and at most 3 of the 8 do, so each kind has at least one refused.
    assert any(r["status"] == 200 for r in probes)
    assert any(r["status"] == 429 and r["stream"] for r in probes)
    assert any(r["status"] == 429 and not r["stream"] for r in probes)

    # The load generator counts 429s as rejected, apart from errors; summaries are over admitted streams.
    res = asyncio.run(run_load(admit_app, [StreamSpec(f"load {i}", max_tokens=200) for i in range(20)],
                               timeout_s=120, report_interval_s=None))
    assert not [r.error for r in res.results if r.error]
    assert res.num_rejected >= 1 and res.num_admitted == 20 - res.num_rejected
    assert res.num_complete == res.num_admitted == len(res.records)
    assert all(r.retry_after_s == RETRY_AFTER_S and r.record is None for r in res.results if r.rejected)

    # And it keeps serving.
    with httpx.Client(timeout=60) as http:
        after = http.post(admit_app + "/v1/completions", json=_body(0, 4, False))
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 4

"""The central scheduling actor over real HTTP (issue 14, item 3), in the default (direct) placement with two
replicas and Serve's default router, so a report reaches its stream's replica directly or through the actor.

- A rate-change report reaches the reader model that the owning replica's scheduler ranks the stream by, whether
  the router sent it to the owner or to the other replica (then it goes through the central actor).
- The actor killed mid-burst loses no stream and no report: streams never wait for it, reports sent while it is
  down are retried into the restarted actor, and the replicas' snapshots rebuild its table, each stream with
  the rate its reader reported during the gap.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.serve.conftest import central_actor

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

APP = "tfcentral"


@pytest.fixture(scope="module")
def central_app(serve_url):
    from tokenflow_ray.serve.app import deploy, undeploy
    from tokenflow_ray.serve.config import ServeConfig

    config = ServeConfig(app_name=APP, route_prefix=f"/{APP}", replicas=2, num_cpus=0.5, policy="tokenflow",
                         max_num_seqs=1, num_device_blocks=512, num_host_blocks=512, images=False)
    try:
        deploy(config)
        yield f"{serve_url}/{APP}", config
    finally:
        undeploy(config)


def _body(i: int, max_tokens: int, rate: float) -> dict:
    return {"model": "embedded", "prompt": f"Reader {i}:", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True, "consumption_rate": rate,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


async def _read(http: httpx.AsyncClient, url: str, i: int, max_tokens: int, rate: float,
                ids: dict[int, str], arrivals: dict[int, list[tuple[float, int]]]) -> dict:
    """One SSE reader: (time, tokens so far) at each event; its id into `ids` at the first one."""
    arrivals[i] = []
    async with http.stream("POST", url + "/v1/completions", json=_body(i, max_tokens, rate)) as resp:
        assert resp.status_code == 200, (await resp.aread()).decode()
        last = None
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return {"done": True, "last": last}
            last = json.loads(line[6:])
            assert "error" not in last, last
            ids.setdefault(i, last["id"])
            arrivals[i].append((time.monotonic(), last["usage"]["completion_tokens"]))
    return {"done": False, "last": last}


def _tokens_between(arrivals: list[tuple[float, int]], t0: float, t1: float) -> int:
    before = max((n for t, n in arrivals if t <= t0), default=0)
    upto = max((n for t, n in arrivals if t <= t1), default=0)
    return upto - before


async def _until(fn, timeout_s: float, interval_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while True:
        value = await fn()
        if value or time.monotonic() > deadline:
            return value
        await asyncio.sleep(interval_s)


def test_a_rate_change_report_reaches_the_owning_replicas_scheduler(central_app):
    """The report changes the reader model the owner's scheduler ranks the stream by (rate, hence buffered
    seconds), whichever replica the router handed the report to."""
    url, config = central_app
    readers, tokens = 6, 400

    central = central_actor(config)

    async def owner_state(sid: str) -> dict | None:
        # The buffer in seconds is the owner's own scheduler's figure (tokens ahead / the rate it ranks by), sent
        # in its batches; a handle call would reach whichever replica Serve's router prefers, not the owner.
        view = await central.view.remote()
        entry = view.get(sid)
        return None if entry is None or entry["buffer_s"] is None else entry

    async def run():
        ids: dict[int, str] = {}
        arrivals: dict[int, list] = {}
        async with httpx.AsyncClient(timeout=120) as http:
            tasks = [asyncio.create_task(_read(http, url, i, 1900 if i == 0 else tokens, 1.0 if i == 0 else 20.0,
                                               ids, arrivals)) for i in range(readers)]
            await _until(lambda: asyncio.sleep(0, len(ids) == readers), 60)
            before = await _until(lambda: owner_state(ids[0]), 10)
            resp = await http.post(f"{url}/v1/streams/{ids[0]}/consumption", json={"rate": 400.0})
            after = await _until(lambda: _rate_is(owner_state, ids[0], 400.0), 10)
            results = await asyncio.gather(*tasks)
        return resp.status_code, before, after, results

    status, before, after, results = asyncio.run(run())
    print(f"reader 0 at its replica: {before} before the report, {after} after")
    assert status == 204, (status, before, after)
    assert all(r["done"] for r in results)
    assert before is not None and before["rate"] == 1.0, before
    # The owner's next batch carries its scheduler's buffer at the new rate (seconds = tokens ahead / rate).
    assert after and after["rate"] == 400.0, (before, after)


async def _buffered_over(owner_state, sid: str, seconds: float) -> dict | None:
    state = await owner_state(sid)
    return state if state is not None and state["buffer_s"] > seconds else None


async def _rate_is(owner_state, sid: str, rate: float) -> dict | None:
    state = await owner_state(sid)
    return state if state is not None and state["rate"] == rate else None


def test_killing_the_central_actor_mid_burst_loses_no_stream_and_no_report(central_app):
    import ray

    url, config = central_app
    central = central_actor(config)
    readers, tokens = 6, 1500  # long enough to be live through the kill, the restart and the rebuild

    async def run():
        ids: dict[int, str] = {}
        arrivals: dict[int, list] = {}
        async with httpx.AsyncClient(timeout=120) as http:
            tasks = [asyncio.create_task(_read(http, url, i, tokens, 20.0, ids, arrivals)) for i in range(readers)]
            await _until(lambda: asyncio.sleep(0, len(ids) == readers), 60)
            def live() -> list[str]:
                return [ids[i] for i, t in enumerate(tasks) if not t.done()]

            before = await _until(lambda: _view_has(central, live()), 10)
            ray.kill(central, no_restart=False)  # Ray restarts it (max_restarts=-1), with an empty table
            # Each reader reports a rate of its own while the actor is down or restarting.
            statuses = await asyncio.gather(*[
                http.post(f"{url}/v1/streams/{ids[i]}/consumption", json={"rate": 20.0 + i, "consumed_tokens": 1})
                for i in range(readers)])
            rebuilt = await _until(lambda: _view_has(central, live(), {ids[i]: 20.0 + i for i in ids
                                                                       if ids[i] in live()}), 30)
            counters = await central.counters.remote()
            results = await asyncio.gather(*tasks)
        return before, [s.status_code for s in statuses], rebuilt, counters, results

    before, statuses, rebuilt, counters, results = asyncio.run(run())
    assert before, "the table never held every live stream"
    assert statuses == [204] * readers, statuses
    assert rebuilt, "the restarted actor's table was not rebuilt with the reported rates"
    assert counters["full_snapshots"] >= 2  # one per replica: the table came from the replicas
    assert all(r["done"] and r["last"]["usage"]["completion_tokens"] == tokens for r in results)


async def _view_has(central, sids, rates: dict[str, float] | None = None) -> bool:
    try:
        view = await central.view.remote()
    except Exception:  # restarting
        return False
    if not all(sid in view for sid in sids):
        return False
    return rates is None or all(view[sid]["rate"] == rate for sid, rate in rates.items())

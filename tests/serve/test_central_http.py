"""The central scheduling actor over real HTTP (issue 14, item 3), in the default (direct) placement with two
replicas and Serve's default router, so a report reaches its stream's replica directly or through the actor.

- A rate-change report changes how the owning replica schedules the stream (which stream its one-stream batch
  runs), whether the router sent it to the owner or to the other replica (then it goes through the central actor).
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
    from tokenflow_ray.engine.policies import TokenFlowConfig
    from tokenflow_ray.serve.app import deploy, undeploy
    from tokenflow_ray.serve.config import ServeConfig, serve_engine

    # One slot a replica: its streams share it by pausing one another, so each stays live for seconds. With
    # behind_leads on, a newcomer waits while the two it would join rotate (each in turn within two leads of
    # running dry) and the first streams end before the kill; these tests need the rotation, not that rule.
    config = ServeConfig(app_name=APP, route_prefix=f"/{APP}", replicas=2, num_cpus=0.5, images=False,
                         engine=serve_engine(policy="tokenflow", max_num_seqs=1, num_device_blocks=512,
                                             num_host_blocks=512, tokenflow=TokenFlowConfig(behind_leads=0.0)))
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
                return {"done": True, "last": last, "done_at": time.monotonic()}
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


def test_a_rate_change_report_changes_how_the_owner_schedules_the_stream(central_app):
    """Slow readers (1 tok/s) on one replica with one-stream batches, so its policy must choose whom to run; they
    soon hold minutes of buffer. The one that got the fewest steps lately reports a 50 tok/s reader: from then on
    the owner feeds it at about that rate or more (its buffer, in seconds of reading, is now the smallest). 50 tok/s keeps
    Σ rates far below the overload fallback's 2Γ (arrival order there, whatever the reports). The report goes
    through Serve's router, so it reaches the owner directly or through the central actor."""
    url, config = central_app
    readers, tokens, rate = 4, 1900, 50.0  # 4 over 2 replicas: some replica owns two (pigeonhole)
    central = central_actor(config)

    async def owner_state(sid: str) -> dict | None:
        # The owner's own scheduler's figures (rate it ranks by, buffer in seconds), sent in its batches; a handle
        # call would reach whichever replica Serve's router prefers, not the owner.
        view = await central.view.remote()
        entry = view.get(sid)
        return None if entry is None or entry["buffer_s"] is None else entry

    async def run():
        ids: dict[int, str] = {}
        arrivals: dict[int, list] = {}
        async with httpx.AsyncClient(timeout=120) as http:
            tasks = [asyncio.create_task(_read(http, url, i, tokens, 1.0, ids, arrivals)) for i in range(readers)]
            await _until(lambda: asyncio.sleep(0, len(ids) == readers), 60)
            view = await _until(lambda: _view_of(central, list(ids.values())), 10)
            owners: dict[str, list[int]] = {}
            for i, sid in sorted(ids.items()):
                owners.setdefault(view[sid]["replica_id"], []).append(i)
            owner, twins = max(owners.items(), key=lambda kv: (len(kv[1]), kv[0]))
            # Every twin runs far ahead of its 1 tok/s reader, past a fifth of its length (a quarter: margin): a token's value (its
            # effective-throughput weight, which the policy's ranking weighs against the time a stream waited) is 0
            # from there on, so from then on only buffers set the order. After a fixed 4 s, a slow box (an AVX2 CI
            # machine: ~40 tok/s a twin) had them at 150-300 of 1900 tokens, still worth a step each, and the
            # ranking shared the steps in turn whatever the report said (84 vs 93 before, 77 vs 119 after).
            await asyncio.sleep(4.0)
            await _until(lambda: asyncio.sleep(0, all(arrivals[i] and arrivals[i][-1][1] > 0.25 * tokens
                                                      for i in twins)), 60)
            now = time.monotonic()
            # The one that got the fewest tokens lately reports: any sudden lead it takes is the report's doing.
            a = min(twins, key=lambda i: (_tokens_between(arrivals[i], now - 2.0, now), i))
            t_report = time.monotonic()
            resp = await http.post(f"{url}/v1/streams/{ids[a]}/consumption", json={"rate": rate})
            after = await _until(lambda: _rate_is(owner_state, ids[a], rate), 10)
            t_applied = time.monotonic()  # the owner's scheduler has the new rate from here (later on a slow box)
            await asyncio.sleep(3.0)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return (resp.status_code, after, t_report, t_applied, arrivals[a],
                [arrivals[i] for i in twins if i != a])

    status, after, t_report, t_applied, got_a, got_others = asyncio.run(run())
    # After: from half a second past the moment the owner showed the new rate (steps already planned drain first).
    window = (t_applied + 0.5, t_applied + 3.0)
    before_a, after_a = (_tokens_between(got_a, t0, t1) for t0, t1 in ((t_report - 2.0, t_report), window))
    before_others = sum(_tokens_between(x, t_report - 2.0, t_report) for x in got_others)
    after_others = sum(_tokens_between(x, *window) for x in got_others)
    print(f"tokens in the 2 s before the report: {before_a} vs {before_others} for the "
          f"{len(got_others)} other stream(s) there; in 2.5 s after: {after_a} vs {after_others}; owner: {after}")
    assert status == 204, status
    assert after and after["rate"] == rate, after  # the owner's scheduler ranks the stream at the new rate
    # Before, the others had at least their share. After, the reporting stream is fed at about its new reading rate
    # or more, and its share of the steps rises by at least 20 points: how far depends on its buffer at the new rate
    # when the report lands (several seconds of reading when the policy had run it early, and the others then keep
    # some steps: 1 vs 233 before and 184 vs 413 after in one CI run; 96 vs 293, then 444 vs 0 in another), so the
    # test asks for the change, not for every step.
    assert before_others > 0 and before_a <= before_others, (before_a, before_others)
    window_s = window[1] - window[0]
    assert after_a >= 0.5 * rate * window_s, (after_a, after_others)
    share_before, share_after = before_a / (before_a + before_others), after_a / (after_a + after_others)
    assert share_after >= share_before + 0.2, (before_a, before_others, after_a, after_others)


async def _view_of(central, sids) -> dict | None:
    view = await central.view.remote()
    return view if all(sid in view for sid in sids) else None


async def _rate_is(owner_state, sid: str, rate: float) -> dict | None:
    state = await owner_state(sid)
    return state if state is not None and state["rate"] == rate else None


def test_killing_the_central_actor_mid_burst_loses_no_stream_and_no_report(central_app):
    """Readers report while the actor is down or restarting. A report for a stream still live when it is answered
    is delivered (204) and its rate is in the rebuilt table; one for a stream its reader saw end first is refused
    (404). The server generates ahead of a reader that has spare capacity, so a stream alone on its replica can
    end within seconds (one did, before the kill, in a clean-clone CI run): which streams outlive the gap is read
    from when each reader saw its end, not assumed."""
    import ray

    url, config = central_app
    central = central_actor(config)
    readers, tokens = 6, 1100  # one replica has three or more: their streams share it for several seconds

    async def report(http: httpx.AsyncClient, sid: str, rate: float) -> tuple[int, float, float]:
        sent = time.monotonic()
        resp = await http.post(f"{url}/v1/streams/{sid}/consumption", json={"rate": rate, "consumed_tokens": 1})
        return resp.status_code, sent, time.monotonic()

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
            reports = [asyncio.create_task(report(http, ids[i], 20.0 + i)) for i in range(readers)]
            # Watched meanwhile: a report for an ended stream is answered only after the rebuild window.
            rebuilt = await _until(lambda: _rebuilt_with(central, live(), {ids[i]: 20.0 + i for i in ids}), 30)
            sent = await asyncio.gather(*reports)
            counters = await central.counters.remote()
            results = await asyncio.gather(*tasks)
        return before, sent, rebuilt, counters, results, ids

    before, sent, rebuilt, counters, results, ids = asyncio.run(run())
    assert before, "the table never held every live stream"
    assert all(r["done"] and r["last"]["usage"]["completion_tokens"] == tokens for r in results)
    statuses = [status for status, _, _ in sent]
    # Live when answered: its reader saw the end well after the answer (2 s: the two arrive on different
    # connections). Ended before: its reader saw the end before sending the report.
    live_through = [i for i in range(readers) if results[i]["done_at"] > sent[i][2] + 2.0]
    ended_before = [i for i in range(readers) if results[i]["done_at"] < sent[i][1]]
    print(f"statuses {statuses}; live through the answer: {live_through}; ended before the report: {ended_before}")
    assert len(live_through) >= readers // 2, "too few streams outlived the gap for the test to mean anything"
    assert all(statuses[i] == 204 for i in live_through), statuses  # no report for a live stream lost
    assert all(statuses[i] == 404 for i in ended_before), statuses
    assert all(s in (204, 404) for s in statuses), statuses
    # The table was rebuilt with the reported rates while those streams were still live.
    assert rebuilt and {ids[i] for i in live_through} <= rebuilt, (rebuilt, live_through)
    assert counters["full_snapshots"] >= 2  # one per replica: the table came from the replicas
    assert counters["restarted"] == 1  # it knew it was restarted, so reports waited for the snapshots


async def _rebuilt_with(central, sids: list[str], rates: dict[str, float]) -> set[str] | None:
    """The live ids, once the view holds each of them with its reader's reported rate (None until then)."""
    ok = await _view_has(central, sids, {sid: rates[sid] for sid in sids})
    return set(sids) if ok and sids else None


async def _view_has(central, sids, rates: dict[str, float] | None = None) -> bool:
    try:
        view = await central.view.remote()
    except Exception:  # restarting
        return False
    if not all(sid in view for sid in sids):
        return False
    return rates is None or all(view[sid]["rate"] == rate for sid, rate in rates.items())

"""Registration is off the token path: a slow central actor delays neither the first token nor an early report."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]

APP = "tfslow"
REGISTER_DELAY_S = 3.0
GRACE_S = 6.0  # longer than the delay: the early report must wait for the registration, not give up


@pytest.fixture(scope="module")
def slow_app(serve_url):
    import ray

    from tokenflow_ray.serve.app import deploy, undeploy
    from tokenflow_ray.serve.config import ServeConfig, serve_engine
    from tokenflow_ray.serve.control.central import (
        ACTOR_OPTIONS,
        CentralScheduler,
        CentralSettings,
        central_name,
    )

    # The ingress placement: its reports go through the central actor (in the direct one a report reaches the
    # stream's own replica, which needs no registration to apply it).
    config = ServeConfig(app_name=APP, route_prefix=f"/{APP}", register_grace_s=GRACE_S,
                         images=False, num_cpus=1, http="ingress", engine=serve_engine(policy="fcfs"))
    settings = CentralSettings(central_name(APP), config.central_namespace, register_grace_s=GRACE_S)

    class SlowRegisterCentral(CentralScheduler):  # defined here, so Ray ships it by value
        async def update(self, replica_id, changes) -> bool:
            if changes.added:
                await asyncio.sleep(REGISTER_DELAY_S)
            return await super().update(replica_id, changes)

    # Created before the app, under the app's name: get_central (get_if_exists=True) then finds this one.
    try:  # the detached actor is killed by name in undeploy, whatever failed after it was created
        slow = ray.remote(**ACTOR_OPTIONS)(SlowRegisterCentral).options(
            name=settings.name, namespace=settings.namespace, lifetime="detached").remote(settings)
        ray.get(slow.view.remote())
        deploy(config)
        yield f"{serve_url}/{APP}"
    finally:
        undeploy(config)  # also kills the central actor by name


def _body(max_tokens: int, rate: float) -> dict:
    return {"model": "embedded", "prompt": "Tell me a story", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True, "consumption_rate": rate}


async def _first_chunk(lines) -> dict:
    async for line in lines:
        if line.startswith("data: "):
            return json.loads(line[6:])
    raise AssertionError("no chunk")


async def _drain(lines) -> None:
    async for _ in lines:
        pass


def test_slow_registration_delays_neither_ttft_nor_an_early_report(slow_app):
    from ray import serve

    llm = serve.get_deployment_handle("LLMServer", APP)
    with httpx.Client(timeout=60) as c:  # warm the replica (its first step); its registration lands later
        assert c.post(slow_app + "/v1/completions", json={**_body(2, 0), "stream": False}).status_code == 200

    async def state(sid: str) -> dict | None:
        return await asyncio.to_thread(lambda: llm.stream_state.remote(sid).result())

    async def run() -> dict:
        async with httpx.AsyncClient(timeout=60) as http:
            out: dict = {}
            # Two long companions keep the engine busy, so the probed stream outlives the registration delay.
            async with http.stream("POST", slow_app + "/v1/completions", json=_body(1900, 0)) as c1, \
                    http.stream("POST", slow_app + "/v1/completions", json=_body(1900, 0)) as c2:
                drains = [asyncio.create_task(_drain(c.aiter_lines())) for c in (c1, c2)]
                start = time.monotonic()
                async with http.stream("POST", slow_app + "/v1/completions", json=_body(1900, 5)) as resp:
                    lines = resp.aiter_lines()
                    sid = (await _first_chunk(lines))["id"]
                    out["ttft_s"] = time.monotonic() - start
                    drain = asyncio.create_task(_drain(lines))
                    t = time.monotonic()
                    report = await http.post(f"{slow_app}/v1/streams/{sid}/consumption",
                                             json={"rate": 2.5, "consumed_tokens": 1})
                    out["report_status"], out["report_s"] = report.status_code, time.monotonic() - t
                    deadline = time.monotonic() + 10
                    while time.monotonic() < deadline:
                        out["state"] = await state(sid)
                        if out["state"] is None or out["state"]["rate"] == 2.5:
                            break
                        await asyncio.sleep(0.1)
                    drain.cancel()
                for d in drains:
                    d.cancel()
            # The client left: the stream is deregistered and reports for it are 404 at once, not after the grace.
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                t = time.monotonic()
                gone = await http.post(f"{slow_app}/v1/streams/{sid}/consumption", json={"rate": 1.0})
                out["gone_status"], out["gone_s"] = gone.status_code, time.monotonic() - t
                if gone.status_code == 404:
                    break
                await asyncio.sleep(0.2)
            return out

    out = asyncio.run(run())
    print({k: v for k, v in out.items() if k != "state"})
    assert out["ttft_s"] < REGISTER_DELAY_S / 2, out  # the first token did not wait for the registration
    assert out["report_status"] == 204, out  # the early report waited for the late registration
    assert out["report_s"] < GRACE_S, out
    assert out["state"] is not None and out["state"]["rate"] == 2.5, out  # and reached the replica's engine
    assert out["gone_status"] == 404 and out["gone_s"] < 1.0, out

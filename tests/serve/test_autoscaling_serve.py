"""Autoscaling on serving signals, end to end: load raises the LLMServer replicas above the minimum, idleness brings
them back, and the replica Serve stops drains its live streams first: none is cut.

Real Serve and HTTP, the embedded model, the tokenflow policy. A closed loop of unpaced streams fills the batch of
the one replica (batch occupancy and waiting streams: the policy asks for more); once the second replica runs, that
loop stops and a smaller closed loop of long streams starts: a few live at any time, which fits one replica, and
Serve's router spreads them over both. The backlog drains, the fleet's demand fits one replica, and Serve stops one
of them while long streams are live on it; the long loop stops once Serve is stopping it. A probe stream
afterwards names the survivor. The timeline (replica states from serve.status(), stream -> replica from the central
actor) is printed.

The long streams are kept live by a loop, not by their length alone: how long 1800 tokens take depends on the box,
and a fixed set of them once all ended (a 2-core AVX-512 EPYC) before Serve stopped the replica, with nothing left
there to drain.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time

import httpx
import pytest

from tokenflow_ray.client.stream import PacedStreamClient, StreamSpec

APP = "tfscale"
BURST_WORKERS = 16
# A tiny declared rate marks the long streams in the central actor's view (the burst's is 0) without adding demand
# or ever making them buffer-critical. LONG_WORKERS of them live at a time (MAX_LONG_WORKERS at most): few enough for
# one replica (the fleet must look idle enough to shrink), spread over both replicas (Serve's default router sends a
# stream to the replica with fewer of its requests in flight), so the replica Serve stops has some when it stops.
LONG_RATE = 0.01
LONG_WORKERS = 4
MAX_LONG_WORKERS = 8  # more only while the long streams are all on one replica
STOP_WAIT_S = 90.0  # from the start: the scale-down comes a few seconds after the burst stops


def _long_spec(i: int) -> StreamSpec:
    return StreamSpec(f"Long stream {i}: a long story about the sea.", max_tokens=1800, rate=LONG_RATE)


PROBE = StreamSpec("Probe: which replica is left?", max_tokens=150)


def _config():
    from tokenflow_ray.serve.config import ServeConfig, serve_engine

    return ServeConfig(
        app_name=APP, num_cpus=0.5, images=False,
        autoscaling={"min_replicas": 1, "max_replicas": 2, "upscale_delay_s": 0.5, "downscale_delay_s": 2.0,
                     "metrics_interval_s": 0.25, "look_back_period_s": 1.0, "pressure_cooldown_s": 2.0,
                     "drain_timeout_s": 60.0},
        engine=serve_engine(policy="tokenflow", max_num_seqs=16, num_device_blocks=1600, num_host_blocks=256))


class Timeline(threading.Thread):
    """Samples replica states and the stream -> replica view every 0.2 s."""

    def __init__(self, central) -> None:
        super().__init__(daemon=True)
        self.central = central
        self.samples: list[dict] = []
        self.stop = threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        import ray
        from ray import serve

        while not self.stop.is_set():
            try:
                dep = serve.status().applications[APP].deployments["LLMServer"]
                states = {str(getattr(k, "value", k)): v for k, v in dep.replica_states.items()}
                view = ray.get(self.central.view.remote(), timeout=5)
            except Exception as exc:  # noqa: BLE001 - a sample lost is only a gap in the record
                states, view = {"error": str(exc)}, {}
            self.samples.append({"t": round(time.monotonic() - self.t0, 2), "states": states,
                                 "streams": {sid: v["replica_id"] for sid, v in view.items()},
                                 "long": {sid: v["replica_id"] for sid, v in view.items() if v["rate"] == LONG_RATE}})
            time.sleep(0.2)

    def running(self) -> int:
        return self.samples[-1]["states"].get("RUNNING", 0) if self.samples else 0


async def _scenario(base_url: str, timeline: Timeline) -> dict:
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(120)) as http:
        client = PacedStreamClient(http, base_url, report_interval_s=0.5)
        await client.run(StreamSpec("warm up", max_tokens=2))
        stop = asyncio.Event()
        burst: list = []

        async def worker(i: int) -> None:
            while not stop.is_set():
                burst.append(await client.run(StreamSpec(f"Burst {i}: tell me about rivers.", max_tokens=32)))

        workers = [asyncio.create_task(worker(i)) for i in range(BURST_WORKERS)]
        t_load = time.monotonic() - timeline.t0
        while timeline.running() < 2 and time.monotonic() - timeline.t0 < 60:
            await asyncio.sleep(0.1)
        t_up = time.monotonic() - timeline.t0
        ended: dict[int, float] = {}
        started: dict[int, float] = {}
        slow_results: list = []
        slow_ids: dict[str, int] = {}  # stream id -> index (started/ended are keyed by it)
        stop_long = asyncio.Event()
        count = itertools.count()

        async def long_worker() -> None:
            while not stop_long.is_set():
                i = next(count)
                started[i] = time.monotonic() - timeline.t0
                res = await client.run(_long_spec(i))
                ended[i] = time.monotonic() - timeline.t0
                slow_results.append(res)
                slow_ids[res.stream_id] = i

        # The burst ends first: while it runs, the router sends the long streams to whichever replica has fewer of
        # its requests in flight, and one run put all six on one replica and Serve stopped the other. Then one by
        # one, so the router sees each before the next, and more until both replicas hold one: whichever Serve
        # stops has long streams live (it moves them to the survivor or serves them to the end).
        stop.set()
        await asyncio.gather(*workers)
        t_burst_done = time.monotonic() - timeline.t0
        long_workers = []
        while len(long_workers) < LONG_WORKERS or (len(set(timeline.samples[-1]["long"].values())) < 2
                                                   and len(long_workers) < MAX_LONG_WORKERS):
            long_workers.append(asyncio.create_task(long_worker()))
            await asyncio.sleep(0.2 if len(long_workers) < LONG_WORKERS else 0.4)
        while not timeline.samples[-1]["states"].get("STOPPING") and timeline.running() == 2:
            if time.monotonic() - timeline.t0 > STOP_WAIT_S:
                break
            await asyncio.sleep(0.1)
        stop_long.set()  # no new long stream: those live finish, on the stopping replica too
        await asyncio.gather(*long_workers)
        while timeline.running() != 1 or any(k != "RUNNING" for k in timeline.samples[-1]["states"]):
            if time.monotonic() - timeline.t0 > 150:
                break
            await asyncio.sleep(0.2)
        probe = await client.run(PROBE)
        return {"burst": burst, "slow": slow_results, "slow_ids": slow_ids, "slow_started": started, "slow_ended": ended, "probe": probe,
                "t_load": t_load, "t_up": t_up, "t_burst_done": t_burst_done}


@pytest.mark.ray
@pytest.mark.timeout(240)
def test_load_scales_up_idleness_scales_down_and_no_stream_is_cut(serve_url):
    from tokenflow_ray.cluster.http_requests import owner_of
    from tokenflow_ray.serve.app import deploy, undeploy
    from tokenflow_ray.serve.control.central import CentralSettings, central_name, get_central

    config = _config()
    timeline = None
    try:
        deploy(config)
        timeline = Timeline(get_central(CentralSettings(central_name(APP), config.central_namespace)))
        timeline.start()
        out = asyncio.run(_scenario(serve_url, timeline))
    finally:
        if timeline is not None:
            timeline.stop.set()
            timeline.join(timeout=10)
        undeploy(config)
    samples = timeline.samples
    running = [s["states"].get("RUNNING", 0) for s in samples]
    # Compact record for the report: replica states whenever they change.
    changes = [s for i, s in enumerate(samples) if i == 0 or s["states"] != samples[i - 1]["states"]]
    slow_ids = out["slow_ids"]
    long_on = {slow_ids[sid]: rid for s in samples for sid, rid in s["long"].items() if sid in slow_ids}
    print(json.dumps({"t_load": out["t_load"], "t_up": out["t_up"], "t_burst_done": out["t_burst_done"],
                      "slow_started": out["slow_started"], "slow_ended": out["slow_ended"],
                      "burst_streams": len(out["burst"]), "long_on": long_on,
                      "states": [(s["t"], s["states"]) for s in changes]}))

    # Load raised the replicas above the minimum, idleness brought them back.
    assert max(running) == 2, changes
    assert samples[-1]["states"] == {"RUNNING": 1}, changes
    # No stream cut or refused: every burst and slow stream ran to its full length.
    for res in out["burst"] + out["slow"] + [out["probe"]]:
        assert res.complete and not res.rejected, (res.error, res.finish_reason)
        assert res.finish_reason == "length" and res.num_tokens == res.spec.max_tokens
    # The stopped replica held slow readers while Serve was stopping it: the drain served them to the end.
    seen = {rid for s in samples for rid in s["streams"].values()}
    # The probe ran on the survivor: its id names the replica that took it (a short stream the 0.2 s samples may miss).
    survivors = {s["streams"][out["probe"].stream_id] for s in samples if out["probe"].stream_id in s["streams"]}
    survivors.add(owner_of(out["probe"].stream_id))
    assert len(survivors) == 1 and len(seen) == 2 and survivors <= seen, (survivors, seen)
    (victim,) = seen - survivors
    on_victim = {slow_ids[sid] for s in samples for sid, rid in s["long"].items() if rid == victim}
    assert on_victim, "no long stream landed on the replica that was stopped: nothing was drained"
    t_stopping = min(s["t"] for s in samples if s["states"].get("STOPPING", 0) > 0)
    live_at_stop = [i for i in on_victim if out["slow_started"][i] < t_stopping < out["slow_ended"][i]]
    assert live_at_stop, (t_stopping, {i: (out["slow_started"][i], out["slow_ended"][i]) for i in on_victim})

"""Stopping the app (serve/replica/stopping.py, lifecycle.py), piece by piece without Ray: the central actor's stop orders,
a replica's refusal and stream ends, what the client is told, the signal handler, and the one-line start error.
The whole path, with a real SIGTERM, is tests/serve/test_serve_cli.py."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from types import SimpleNamespace

import pytest
from ray.exceptions import RayTaskError

from tests.serve.front.test_errors import FakeGen, delta, events, fake_ingress, generate
from tokenflow_ray.cluster.messages import StopOrder
from tokenflow_ray.serve.control.central import CentralScheduler, CentralSettings
from tokenflow_ray.serve.http.errors import ServerStopping, stream_failure
from tokenflow_ray.serve.http.protocol import APIError
from tokenflow_ray.serve.lifecycle import StopSignal, replica_failure
from tokenflow_ray.serve.replica.stopping import ReplicaStopping

pytestmark = pytest.mark.timeout(60)


def test_every_replica_gets_one_stop_order_and_stop_serving_returns_once_they_took_it():
    central = CentralScheduler(CentralSettings("central", "ns", poll_s=1.0, push_interval_s=0.0))

    async def run():
        first = await central.wait_reports("r1")  # r1 known; its next poll is open when the stop comes
        polling = asyncio.create_task(central.wait_reports("r1"))
        await asyncio.sleep(0.05)
        told = await asyncio.wait_for(central.stop_serving("SIGTERM"), 2.0)  # returns as r1 takes its order
        r1 = await polling
        late = await central.wait_reports("r2")  # a replica that polls only now is told too
        again = await asyncio.wait_for(central.wait_reports("r1"), 3.0)  # and nobody twice
        return first, told, r1, late, again

    first, told, r1, late, again = asyncio.run(run())
    assert first == [] and told == 1
    assert r1 == [StopOrder("SIGTERM")] and late == [StopOrder("SIGTERM")] and again == []


class FakeReplica(ReplicaStopping):
    def __init__(self, live: list[str]) -> None:
        self.changes = SimpleNamespace(live=dict.fromkeys(live))
        self.ticked: list[str] = []
        self.aengine = SimpleNamespace(tick=self.ticked.append)


def test_a_replica_told_to_stop_wakes_every_live_stream_and_refuses_new_ones():
    replica = FakeReplica(["a", "b"])
    replica._check_stopping()  # serving: nothing happens
    replica._stop_serving(StopOrder("SIGTERM"))
    assert replica.ticked == ["a", "b"]  # each stream's loop runs now, sees the flag and ends
    with pytest.raises(ServerStopping):
        replica._check_stopping()
    replica._stop_serving(StopOrder("again"))  # a second order changes nothing
    assert replica.ticked == ["a", "b"] and replica._stopping == "SIGTERM"


@pytest.mark.parametrize("exc", [ServerStopping("SIGTERM"),
                                 RayTaskError("generate", "Traceback ...", ServerStopping("x")).as_instanceof_cause()])
def test_a_stopping_server_is_a_retryable_503_the_client_can_read(exc):
    err = stream_failure(exc, "cmpl-9")
    assert (err.status, err.code, err.retry_after_s) == (503, "server_shutting_down", 1)
    assert "shutting down" in err.message and "cmpl-9" in err.message


def test_a_stream_the_server_stops_ends_with_an_error_event_then_done():
    out = events(generate(fake_ingress(FakeGen(delta("a", 1), ServerStopping("SIGTERM"))), stream=True))
    assert json.loads(out[0])["choices"][0]["text"] == "a"
    assert json.loads(out[1])["error"]["code"] == "server_shutting_down"
    assert out[2:] == ["[DONE]"]


def test_a_new_request_while_stopping_is_a_plain_503():
    with pytest.raises(APIError) as info:
        generate(fake_ingress(FakeGen(ServerStopping("SIGTERM"))), stream=True)
    assert (info.value.status, info.value.code) == (503, "server_shutting_down")


def test_sigterm_and_sigint_set_the_stop_event_and_a_second_signal_interrupts():
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    stop = StopSignal()
    try:
        stop.install()
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.event.wait(5.0) and stop.name == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            signal.sigtimedwait([], 0.5) if hasattr(signal, "sigtimedwait") else None
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


SERVE_FAILURE = """Deploying application tokenflow failed: Failed to update the deployments ['LLMServer'].
Traceback (most recent call last):
  File "/ray/serve/_private/replica.py", line 1203, in initialize_and_get_metadata
    await self._replica_impl.initialize(deployment_config)
ray.exceptions.RayTaskError(RuntimeError): ray::ServeReplica:tokenflow:LLMServer.initialize_and_get_metadata()
  File "/repo/tokenflow_ray/runner/model_runner.py", line 121, in __init__
    self.transfer = KVTransfer(self.kv_cache, cc.num_host_blocks, cc.overlap_copies)
RuntimeError: [enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried \
to allocate 108086391056891904 bytes. Error code 12 (Cannot allocate memory)
"""


def test_a_replica_failure_is_its_own_last_exception_line():
    line = replica_failure(RuntimeError(SERVE_FAILURE))
    assert line.startswith("a replica failed to start: RuntimeError: [enforce fail") and "\n" not in line
    assert "can't allocate memory" in line
    plain = replica_failure(RuntimeError("Deploying application x failed: unknown"))
    assert plain == "a replica failed to start: Deploying application x failed: unknown"


def test_the_watcher_prints_one_line_per_replica_start_and_stop():
    from tokenflow_ray.serve.config import ServeConfig, serve_engine
    from tokenflow_ray.serve.lifecycle import ReplicaWatcher

    pool = {"gauges": {"device_blocks_total": 64.0, "host_blocks_total": 128.0, "block_size": 16.0}}
    views = [None, {"r1": pool}, {"r1": pool, "r2": pool}, {"r1": pool}, {"r1": pool}]

    class Watcher(ReplicaWatcher):
        def _stats(self):
            return views.pop(0)

    lines: list[str] = []
    watcher = Watcher(ServeConfig(images=False, engine=serve_engine(policy="fcfs")), out=lines.append)
    for _ in range(5):
        watcher.poll()
    watcher.all_stopped("server stopped")
    described = "KV pool 64 device + 128 host blocks of 16 tokens, policy fcfs"
    assert lines == [f"replica r1 started: {described}", f"replica r2 started: {described}",
                     f"replica r2 stopped (no longer reporting): {described}",
                     f"replica r1 stopped (server stopped): {described}"]

"""A replica's failed stream, as the client sees it (errors.py and the ingress's error paths; no Ray instance).

The ingress placement's methods run on a subclass of the undecorated ingress class with fakes for the LLMServer
handle and the central actor, so the before-first-token, mid-stream and non-streaming paths are deterministic here; the real
kill is tests/serve/test_faults.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from types import SimpleNamespace

import pytest
from ray.core.generated.common_pb2 import ActorDiedErrorContext
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError
from ray.serve.exceptions import ReplicaUnavailableError

from tokenflow_ray.cluster.messages import Delta
from tokenflow_ray.serve.control.central import CentralSettings
from tokenflow_ray.serve.http.errors import replica_gone, stream_failure
from tokenflow_ray.serve.http.ingress import IngressSettings, _error_response, make_ingress
from tokenflow_ray.serve.http.protocol import APIError, CompletionRequest

pytestmark = pytest.mark.timeout(60)

ACTOR_HEX = "ab" * 16


def killed() -> ActorDiedError:
    """What the handle raises for a replica killed by ray.kill (Ray 2.60's message carries all of this)."""
    return ActorDiedError(ActorDiedErrorContext(
        error_message="The actor was killed by `ray.kill`.", class_name="ServeReplica:tf:LLMServer",
        actor_id=bytes.fromhex(ACTOR_HEX), pid=4242, name="SERVE_REPLICA::tf#LLMServer#x1", ray_namespace="serve",
        node_ip_address="10.1.2.3"))


def assert_no_internals(message: str) -> None:
    assert ACTOR_HEX not in message and "4242" not in message and "10.1.2.3" not in message
    assert not re.search(r"\b(pid|ip|namespace|actor_id|SERVE_REPLICA)\b", message), message


@pytest.mark.parametrize("exc", [
    killed(),
    ActorUnavailableError("connection reset", bytes.fromhex(ACTOR_HEX)),
    RayTaskError("generate", "Traceback ...", ActorDiedError()).as_instanceof_cause(),  # wrapped by a hop
    ReplicaUnavailableError("tf#LLMServer#x1"),
])
def test_a_gone_replica_is_a_short_retryable_503(exc):
    err = stream_failure(exc, "cmpl-42")
    body = err.body()["error"]
    assert (err.status, body["code"], body["type"], err.retry_after_s) == (
        503, "replica_unavailable", "service_unavailable", 1)
    assert set(body) == {"message", "type", "param", "code"} and "cmpl-42" in body["message"]
    assert_no_internals(body["message"])


def test_wrapping_is_followed_through_cause_chains():
    try:
        try:
            raise killed()
        except ActorDiedError as inner:
            raise RuntimeError("while reading the stream") from inner
    except RuntimeError as outer:
        assert replica_gone(outer)
    assert not replica_gone(RuntimeError("boom"))


def test_anything_else_is_a_500_internal_error_without_its_text():
    err = stream_failure(RuntimeError("secret detail pid 4242"), "cmpl-7")
    body = err.body()["error"]
    assert (err.status, body["code"], err.retry_after_s) == (500, "internal_error", None)
    assert "cmpl-7" in body["message"] and "secret" not in body["message"] and "4242" not in body["message"]


def test_the_503_response_carries_retry_after():
    resp = _error_response(stream_failure(killed(), "cmpl-1"))
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
    assert json.loads(resp.body)["error"]["code"] == "replica_unavailable"


# ---- the ingress's error paths with a fake replica stream ---------------------------------------------------------
class FakeGen:
    """A DeploymentResponseGenerator stand-in: yields deltas, raises exceptions in its script."""

    def __init__(self, *script: Delta | BaseException) -> None:
        self.script, self.cancelled = list(script), False

    def __aiter__(self) -> FakeGen:
        return self

    async def __anext__(self) -> Delta:
        if not self.script:
            raise StopAsyncIteration
        item = self.script.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


class Deregistered:
    def __init__(self) -> None:
        self.ids: list[str] = []

    def remote(self, stream_id: str) -> None:
        self.ids.append(stream_id)


def fake_ingress(gen: FakeGen):
    base = make_ingress().__mro__[1]  # the class under @serve.ingress's wrapper

    class Ingress(base):
        def __init__(self) -> None:  # no handle, no central actor
            self.http = IngressSettings("embedded", 16, 1 << 20, None, CentralSettings("central", "ns"))
            self.llm = SimpleNamespace(generate=SimpleNamespace(remote=lambda req, follow_moves=False: gen))
            self.central = SimpleNamespace(deregister=Deregistered())

    return Ingress()


def delta(text: str, n: int, finished: bool = False) -> Delta:
    return Delta(text, 1, 3, n, finished, "length" if finished else None)


def generate(ingress, stream: bool):
    req = CompletionRequest(model="embedded", prompt="hi", max_tokens=8, stream=stream)

    async def run():
        resp = await ingress._generate(req, "cmpl-", prompt="hi")
        if not stream:
            return resp
        return [chunk async for chunk in resp.body_iterator]

    return asyncio.run(run())


def events(chunks: list[bytes]) -> list[str]:
    return [line[6:] for line in b"".join(chunks).decode().splitlines() if line.startswith("data: ")]


def test_a_replica_dying_before_the_first_token_is_an_http_503(caplog):
    ingress = fake_ingress(FakeGen(killed()))
    with caplog.at_level(logging.ERROR, logger="tokenflow_ray.serve.http.ingress"), pytest.raises(APIError) as info:
        generate(ingress, stream=True)
    err = info.value
    assert (err.status, err.code) == (503, "replica_unavailable")
    sid = ingress.central.deregister.ids[0]
    assert sid.startswith("cmpl-") and sid in err.message
    # The server log keeps what the client is not told: the stream id with Ray's actor details.
    logged = "\n".join(r.getMessage() + (r.exc_text or "") for r in caplog.records)
    assert sid in logged and "10.1.2.3" in logged and "4242" in logged


def test_a_replica_dying_mid_stream_sends_an_error_event_then_done():
    ingress = fake_ingress(FakeGen(delta("a", 1), delta("b", 2), killed()))
    out = events(generate(ingress, stream=True))
    assert [json.loads(e)["choices"][0]["text"] for e in out[:2]] == ["a", "b"]
    err = json.loads(out[2])["error"]
    assert err["code"] == "replica_unavailable" and err["type"] == "service_unavailable"
    assert_no_internals(err["message"])
    assert out[3] == "[DONE]" and len(out) == 4
    assert ingress.central.deregister.ids == [json.loads(out[0])["id"]]


def test_an_unexpected_mid_stream_failure_is_a_500_event_then_done():
    gen = FakeGen(delta("a", 1), RuntimeError("bug"))
    ingress = fake_ingress(gen)
    out = events(generate(ingress, stream=True))
    err = json.loads(out[1])["error"]
    assert err["code"] == "internal_error" and "bug" not in err["message"] and out[2] == "[DONE]"
    assert gen.cancelled and ingress.central.deregister.ids == []  # a live replica deregisters its own streams


def test_a_replica_dying_mid_response_is_a_503_without_a_partial_body():
    ingress = fake_ingress(FakeGen(delta("a", 1), killed()))
    with pytest.raises(APIError) as info:
        generate(ingress, stream=False)
    assert (info.value.status, info.value.code) == (503, "replica_unavailable")


def test_a_stream_that_ends_normally_is_untouched():
    ingress = fake_ingress(FakeGen(delta("a", 1), delta("b", 2, finished=True)))
    out = events(generate(ingress, stream=True))
    assert out[-1] == "[DONE]" and not any('"error"' in e for e in out)
    assert ingress.central.deregister.ids == []


class FakePort:
    """A StreamPort stand-in: `take` hands out its script's batches; `cancel` is recorded."""

    def __init__(self, *batches: list) -> None:
        self.batches, self.cancelled = list(batches), []

        async def take(stream_id: str) -> list:
            item = self.batches.pop(0)
            if isinstance(item, BaseException):
                raise item
            return item

        self.take = SimpleNamespace(remote=take)
        self.cancel = SimpleNamespace(remote=self.cancelled.append)


def test_a_moved_stream_is_followed_to_its_new_replica_and_a_lost_one_fails_cleanly():
    """The replica the stream left says where it went (a drain or a relief); the ingress reads the rest there, so
    the client sees one stream; if the new replica dies, the client gets the 503 error event as for any replica."""
    port = FakePort([delta("c", 3)], [], [delta("d", 4, finished=True)])
    gen = FakeGen(delta("a", 1), Delta("b", 1, 3, 2, moved_to=port))
    ingress = fake_ingress(gen)
    out = events(generate(ingress, stream=True))
    texts = [json.loads(e)["choices"][0]["text"] for e in out[:-1] if json.loads(e).get("choices")]
    assert "".join(texts) == "abcd" and out[-1] == "[DONE]" and not any('"error"' in e for e in out)
    assert port.cancelled == [] and not port.batches

    lost = FakePort([delta("c", 3)], killed())
    out = events(generate(fake_ingress(FakeGen(delta("a", 1), Delta("", 0, 3, 1, moved_to=lost))), stream=True))
    assert out[-1] == "[DONE]" and json.loads(out[-2])["error"]["code"] == "replica_unavailable"
    assert len(lost.cancelled) == 1  # the follower told the port it stopped reading

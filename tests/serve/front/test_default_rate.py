"""ServeConfig.default_rate is resolved once, where a request comes in: the HTTP route gives every stream its rate
(the request's consumption_rate, else the server's default), and the replica and its engine take it as given."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.serve.front.test_errors import FakeGen, delta, events
from tokenflow_ray.serve.app import build_app
from tokenflow_ray.serve.config import ServeConfig
from tokenflow_ray.serve.control.central import CentralSettings
from tokenflow_ray.serve.http.ingress import IngressSettings, make_ingress
from tokenflow_ray.serve.http.protocol import CompletionRequest

pytestmark = pytest.mark.timeout(60)


def _ingress(default_rate: float, sent: list):
    base = make_ingress().__mro__[1]  # the class under @serve.ingress's wrapper

    class Ingress(base):
        def __init__(self) -> None:  # no handle, no central actor: the GenerateRequest is what it sends
            self.http = IngressSettings("embedded", 16, 1 << 20, None, CentralSettings("central", "ns"),
                                        default_rate=default_rate)
            self.llm = SimpleNamespace(generate=SimpleNamespace(
                remote=lambda req, follow_moves=False: sent.append(req) or FakeGen(delta("a", 1, finished=True))))

    return Ingress()


async def _send(ingress, **fields) -> None:
    req = CompletionRequest(model="embedded", prompt="hi", max_tokens=8, stream=True, **fields)
    resp = await ingress._generate(req, "cmpl-", prompt="hi")
    assert events([chunk async for chunk in resp.body_iterator])[-1] == "[DONE]"


@pytest.mark.parametrize("default_rate", [0.0, 12.5])
async def test_a_request_without_a_rate_gets_the_servers_default_and_a_declared_one_its_own(default_rate):
    sent: list = []
    ingress = _ingress(default_rate, sent)
    await _send(ingress)
    await _send(ingress, consumption_rate=3.0)
    await _send(ingress, consumption_rate=0.0)  # declared unpaced stays unpaced
    assert [req.rate for req in sent] == [default_rate, 3.0, 0.0]


def test_the_app_hands_the_default_to_both_edges():
    """The HTTP routes (either placement) and the slack router get ServeConfig.default_rate; the engine has none."""
    for http in ("direct", "ingress"):
        app = build_app(ServeConfig(router="slack", default_rate=6.0, images=False, http=http))
        front = llm = app._bound_deployment  # direct: the replicas answer HTTP
        if http == "ingress":
            llm = front.init_args[0]._bound_deployment  # the ingress is bound to the LLMServer app
        settings = llm.init_args[2] if http == "direct" else front.init_args[1]
        assert isinstance(settings, IngressSettings) and settings.default_rate == 6.0
        assert llm._deployment_config.request_router_config.request_router_kwargs["default_rate"] == 6.0
    assert not hasattr(ServeConfig().engine, "default_rate")

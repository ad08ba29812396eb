"""Speed work keeps every decision: the engine's plans, outputs and records on seeded workloads under fcfs,
tokenflow and andes (fake runner, overlapped scheduling, the host bench's H200 regime on the null runner, and the
simulator's summary) hash to the golden digests captured before it (plan_digest.py says how they were made and
how to write them again when decisions change on purpose)."""

from __future__ import annotations

import json

import pytest

from tests.engine.plan_digest import CASES, GOLDEN

_GOLDEN = json.loads(GOLDEN.read_text())


def test_every_case_has_a_golden_digest():
    assert set(_GOLDEN) == set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_decisions_match_the_golden_digest(name):
    got = CASES[name]()
    want = _GOLDEN[name]
    assert got == want, f"{name}: the engine's decisions changed ({got} != {want})"


def test_the_digest_sees_a_changed_decision(monkeypatch):
    """A one-block change in what the policy may do shows in the digest: the check can fail."""
    from tokenflow_ray.engine.policies.fcfs import FCFSPolicy

    monkeypatch.setattr(FCFSPolicy, "reserve_tokens", lambda self, running: 8)
    assert CASES["fake/fcfs"]() != _GOLDEN["fake/fcfs"]

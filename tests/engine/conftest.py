"""Every test of a module that builds fake engines runs twice: with the fake runner's copies landing before the
step's KV writes, and after them (`late`), as a GPU's side streams land them. A block freed while its copy is still
to land (a paused stream's tail, a host block an import reuses) then corrupts the output and fails the test."""

from __future__ import annotations

import pytest

from tests.engine import factories


@pytest.fixture(autouse=True)
def copy_landing(request, monkeypatch):
    mode = getattr(request, "param", "early")
    monkeypatch.setattr(factories, "LATE_COPIES", mode == "late")
    return mode


def pytest_generate_tests(metafunc):
    if getattr(metafunc.module, "make_fake_engine", None) is factories.make_fake_engine:
        metafunc.parametrize("copy_landing", ["early", "late"], indirect=True)

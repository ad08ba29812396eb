import os
import warnings

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # before any Ray call (token auth is on by default since 2.59)
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
# The Train controller collects reports and notices a dead worker at this poll (2 s by default): a test fit of 8-12
# steps then spends most of a step's second waiting for it (here 0.5 s took a killed fit from 80 to 73 s).
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")


@pytest.fixture(scope="session")
def ray_session(ray_instance):
    """The session-wide Ray instance (tests/conftest.py)."""
    return ray_instance


@pytest.fixture(scope="session")
def digits_parquet(tmp_path_factory):
    from tokenflow_ray.tokenizer.training.datasets import write_generated

    return write_generated("digits", tmp_path_factory.mktemp("data"), num_images=256, side=32, seed=0)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="LPIPS skipped")
        yield

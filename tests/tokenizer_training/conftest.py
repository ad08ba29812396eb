import os
import warnings

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # before any Ray call (token auth is on by default since 2.59)
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")


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

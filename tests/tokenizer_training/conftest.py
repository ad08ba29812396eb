import os
import socket
import warnings

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # before any Ray call (token auth is on by default since 2.59)
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_session():
    """One Ray instance per pytest session; shut down only if this fixture started it."""
    import ray

    started = False
    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, namespace=f"tftrain{os.getpid()}",
                 object_store_memory=200 << 20, log_to_driver=False)
        started = True
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="session")
def digits_parquet(tmp_path_factory):
    from tokenflow_ray.tokenizer.training.datasets import write_generated

    return write_generated("digits", tmp_path_factory.mktemp("data"), num_images=256, side=32, seed=0)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="LPIPS skipped")
        yield

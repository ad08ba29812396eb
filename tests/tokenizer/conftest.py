import warnings

import pytest
import torch


@pytest.fixture(autouse=True)
def _lean_torch():
    torch.set_num_threads(1)  # the box is shared: keep each test on one core
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="LPIPS skipped")
        yield

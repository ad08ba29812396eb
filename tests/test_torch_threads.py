import pytest
import torch

from tokenflow_ray.torch_threads import torch_threads


def test_the_count_is_set_inside_and_the_callers_comes_back_even_on_an_error():
    before = torch.get_num_threads()
    inner = 1 if before != 1 else 2
    with pytest.raises(RuntimeError, match="boom"), torch_threads(inner):
        assert torch.get_num_threads() == inner
        raise RuntimeError("boom")
    assert torch.get_num_threads() == before

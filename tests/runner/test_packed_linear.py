import pytest
import torch
from torch import nn

from tokenflow_ray.models.packed_linear import PackedLinear, onednn_linear_available

pytestmark = pytest.mark.skipif(not onednn_linear_available(), reason="needs oneDNN")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 32, 300])
def test_packed_linear_matches_nn_linear(rows, bias):
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=bias)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        torch.testing.assert_close(PackedLinear(linear)(x), linear(x), rtol=1e-5, atol=1e-5)


def test_runner_packs_every_linear_on_cpu_fp32(tiny_llama_dir):
    from tokenflow_ray.engine.config import CacheConfig, EngineConfig, ModelConfig
    from tokenflow_ray.runner.model_runner import TorchModelRunner

    runner = TorchModelRunner(EngineConfig(model=ModelConfig(model=str(tiny_llama_dir), dtype="float32",
                                                             device="cpu"),
                                           cache=CacheConfig(block_size=16, num_device_blocks=8)))
    model = runner.model
    assert isinstance(model.lm_head, PackedLinear)
    assert all(isinstance(getattr(layer, n), PackedLinear) for layer in model.layers
               for n in ("qkv", "o", "gate_up", "down"))

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


def test_bound_tensors_follow_the_module_when_it_is_moved_or_repacked():
    """PackedLinear and DecoderLayer keep their hot-path tensors and projections as plain attributes; those must
    follow the module: buffers replaced by `_apply` (.to(), .cpu(), a clone) and projections packed after the
    first forward."""
    from tokenflow_ray.models.llama import DecoderLayer
    from tokenflow_ray.models.packed_linear import pack_linears

    torch.manual_seed(0)
    linear = nn.Linear(32, 48)
    packed = PackedLinear(linear)
    x = torch.randn(5, 32)
    with torch.inference_mode():
        want = packed(x)
        packed._apply(lambda t: t.clone())  # every buffer replaced by a new tensor
        assert packed._call[1] is packed.packed_weight and packed._call[2] is packed.bias
        torch.testing.assert_close(packed(x), want)
    layer = DecoderLayer(hidden=32, heads=4, kv_heads=2, head_dim=8, intermediate=64, eps=1e-6, qkv_bias=False)
    assert layer._bind_fused()[2] == layer.qkv.forward
    pack_linears(layer, ("qkv", "o", "gate_up", "down"))
    assert layer._fused is None  # setting a projection drops the binding
    assert layer._bind_fused()[2] == layer.qkv.forward and isinstance(layer.qkv, PackedLinear)
    layer._apply(lambda t: t.clone())
    assert layer._fused is None

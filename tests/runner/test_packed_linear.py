import pytest
import torch
from torch import nn

from tokenflow_ray.layers.cpu_kernels import load_packed_gemm
from tokenflow_ray.layers.packed_linear import PackedLinear, onednn_linear_available, resolve_cpu_gemm

pytestmark = pytest.mark.skipif(not onednn_linear_available() or load_packed_gemm() is None,
                                reason="needs oneDNN and a C++ compiler")


@pytest.mark.parametrize("kernel", ["tokenflow", "onednn"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [0, 1, 7, 32, 300])
def test_packed_linear_matches_nn_linear(rows, bias, kernel):
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=bias)  # 160 columns: the last panel is partial at either width
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        torch.testing.assert_close(PackedLinear(linear, kernel)(x), linear(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lanes", [8, 16])
@pytest.mark.parametrize("shape", [(1, 64, 64), (5, 100, 70), (33, 640, 384), (4, 384, 1024), (130, 33, 300)])
def test_panel_gemm_matches_float64_at_both_vector_widths(lanes, shape):
    """Both builds (a 16-lane one runs on AVX2 as pairs of halves): partial panels, row tails, several k chunks."""
    gemm = load_packed_gemm(lanes)
    assert gemm.lanes() == lanes and gemm.panel_width() == {16: 64, 8: 16}[lanes]
    rows, n, k = shape
    torch.manual_seed(1)
    x, w, b = torch.randn(rows, k), torch.randn(n, k), torch.randn(n)
    want = torch.nn.functional.linear(x.double(), w.double(), b.double())
    got = gemm.linear(x, gemm.pack(w), n, b)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4 * k ** 0.5)
    assert gemm.linear(x.view(1, rows, k), gemm.pack(w), n).shape == (1, rows, n)  # leading dimensions kept


@pytest.mark.parametrize("lanes", [8, 16])
def test_panel_gemm_gives_a_row_the_same_bits_in_any_batch_and_on_any_thread_count(lanes):
    """Each output is one multiply-add chain over k: a stream's logits do not depend on what else is batched (37
    rows: register blocks of 4 or 6 rows and a tail, against one row at a time)."""
    gemm = load_packed_gemm(lanes)
    torch.manual_seed(2)
    x, w = torch.randn(37, 1024), torch.randn(200, 1024)
    panels = gemm.pack(w)
    batched = gemm.linear(x, panels, 200)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([gemm.linear(x[i:i + 1], panels, 200) for i in range(37)])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batched, alone)


def test_bad_gemm_inputs_are_refused():
    gemm = load_packed_gemm()
    panels = gemm.pack(torch.randn(64, 16))
    with pytest.raises(RuntimeError, match="last dimension"):
        gemm.linear(torch.randn(2, 15), panels, 64)
    with pytest.raises(RuntimeError, match="panels"):
        gemm.linear(torch.randn(2, 16), panels, 200)
    with pytest.raises(RuntimeError, match="float32"):
        gemm.linear(torch.randn(2, 16, dtype=torch.float64), panels, 64)
    with pytest.raises(ValueError, match="cpu_gemm"):
        resolve_cpu_gemm("mkl")


def test_auto_picks_the_panel_gemm_on_avx512_and_onednn_elsewhere():
    want = "tokenflow" if load_packed_gemm().lanes() == 16 else "onednn"
    assert resolve_cpu_gemm("auto") == want
    assert resolve_cpu_gemm("onednn") == "onednn" and resolve_cpu_gemm("tokenflow") == "tokenflow"


def test_runner_packs_every_linear_on_cpu_fp32(tiny_llama_dir):
    from tokenflow_ray.engine.config import CacheConfig, EngineConfig, ModelConfig
    from tokenflow_ray.runner.model_runner import TorchModelRunner

    runner = TorchModelRunner(EngineConfig(model=ModelConfig(model=str(tiny_llama_dir), dtype="float32",
                                                             device="cpu"),
                                           cache=CacheConfig(block_size=16, num_device_blocks=8)))
    model = runner.model
    assert runner.gemm == resolve_cpu_gemm("auto")
    assert isinstance(model.lm_head, PackedLinear) and model.lm_head.kernel == runner.gemm
    assert all(isinstance(getattr(layer, n), PackedLinear) and getattr(layer, n).kernel == runner.gemm
               for layer in model.layers for n in ("qkv", "o", "gate_up", "down"))


def test_bound_tensors_follow_the_module_when_it_is_moved_or_repacked():
    """PackedLinear and DecoderLayer keep their hot-path tensors and projections as plain attributes; those must
    follow the module: buffers replaced by `_apply` (.to(), .cpu(), a clone) and projections packed after the
    first forward."""
    from tokenflow_ray.layers.packed_linear import pack_linears
    from tokenflow_ray.models.llama import DecoderLayer

    torch.manual_seed(0)
    linear = nn.Linear(32, 48)
    x = torch.randn(5, 32)
    for kernel in ("tokenflow", "onednn"):
        packed = PackedLinear(linear, kernel)
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

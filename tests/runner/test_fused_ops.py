"""The fused CPU kernels against the reference torch ops they replace (models/llama.py's unfused path)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenflow_ray.layers.cpu_kernels import compiler_available, load_fused_ops
from tokenflow_ray.models.llama import _rope

pytestmark = pytest.mark.skipif(not compiler_available(), reason="needs a C++ compiler")


@pytest.fixture(scope="module")
def ops():
    built = load_fused_ops()
    assert built is not None  # with a compiler the kernels must build: a silent fallback would hide a broken build
    return built


@pytest.mark.parametrize("T,H", [(1, 64), (33, 384), (300, 96)])
def test_add_rms_norm_matches_reference_and_updates_the_residual(ops, T, H):
    g = torch.Generator().manual_seed(T)
    x, res, w = torch.randn(T, H, generator=g), torch.randn(T, H, generator=g), torch.randn(H, generator=g)
    want_res = res + x
    want = F.rms_norm(want_res, (H,), w, 1e-6)
    got = ops.add_rms_norm_(x, res, w, 1e-6)
    assert torch.equal(res, want_res)  # the residual stream is updated in place, exactly
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    plain = ops.add_rms_norm_(x.new_empty(0), res.clone(), w, 1e-6)  # no residual add: the first layer's norm
    torch.testing.assert_close(plain, F.rms_norm(res, (H,), w, 1e-6), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("T,inter", [(1, 16), (32, 1024), (7, 40)])  # 40: a tail past the 16-wide vectors
def test_silu_mul_matches_reference(ops, T, inter):
    gu = torch.randn(T, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 6
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gu), F.silu(gate) * up, rtol=1e-6, atol=1e-6)
    big = torch.tensor([[-200.0, 200.0, 0.0, -1e-30]]).repeat(1, 8)  # exp's range clamps, no inf/nan
    g2, u2 = big.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_mul(big), F.silu(g2) * u2)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(6, 2, 64), (4, 4, 16), (8, 1, 128)])
def test_rope_and_kv_write_match_reference(ops, heads, kv_heads, head_dim):
    T, blocks, bs, max_pos = 9, 6, 4, 64
    g = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(T, (heads + 2 * kv_heads) * head_dim, generator=g)
    pos = torch.randint(0, max_pos, (T,), generator=g)
    ang = torch.randn(max_pos, head_dim // 2, generator=g)
    cos, sin = torch.cat([ang.cos()] * 2, -1).contiguous(), torch.cat([ang.sin()] * 2, -1).contiguous()
    slots = torch.randperm(blocks * bs, generator=g)[:T]
    k_cache, v_cache = torch.zeros(blocks, bs, kv_heads, head_dim), torch.zeros(blocks, bs, kv_heads, head_dim)
    qk = qkv[:, :(heads + kv_heads) * head_dim].reshape(T, heads + kv_heads, head_dim)
    want = _rope(qk, cos[pos], sin[pos])
    v_want = qkv[:, (heads + kv_heads) * head_dim:].reshape(T, kv_heads, head_dim).clone()
    ops.rope_write_kv_(qkv, pos, cos, sin, k_cache, v_cache, slots, heads, kv_heads, head_dim)
    got = qkv[:, :(heads + kv_heads) * head_dim].view(T, heads + kv_heads, head_dim)
    assert torch.equal(got, want)  # same products and sums, rounded the same way (-ffp-contract=off)
    assert torch.equal(k_cache.view(-1, kv_heads, head_dim)[slots], want[:, heads:])
    assert torch.equal(v_cache.view(-1, kv_heads, head_dim)[slots], v_want)
    untouched = torch.ones(blocks * bs, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache.view(-1, kv_heads * head_dim)[untouched].any()


def test_bad_inputs_are_refused(ops):
    with pytest.raises(RuntimeError, match="float32"):
        ops.silu_mul(torch.zeros(2, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="width"):
        ops.rope_write_kv_(torch.zeros(2, 10), torch.zeros(2, dtype=torch.long), torch.zeros(4, 2),
                           torch.zeros(4, 2), torch.zeros(1, 2, 1, 2), torch.zeros(1, 2, 1, 2),
                           torch.zeros(2, dtype=torch.long), 1, 1, 2)
    with pytest.raises(RuntimeError, match="slot out of range"):
        ops.rope_write_kv_(torch.zeros(1, 6), torch.zeros(1, dtype=torch.long), torch.zeros(4, 2),
                           torch.zeros(4, 2), torch.zeros(1, 2, 1, 2), torch.zeros(1, 2, 1, 2),
                           torch.tensor([5]), 1, 1, 2)


def test_argmax_rows_is_torch_argmax_ties_and_nan_included(ops):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(33, 320, generator=g)
    logits[3, [5, 200]] = 50.0  # a tie: the first index, as torch.argmax
    logits[4, [7, 9]] = float("nan")  # NaN is the maximum, the first one
    logits[5, 0] = float("nan")
    logits[6] = float("-inf")
    got = ops.argmax_rows(logits)
    assert got == logits.argmax(dim=-1).tolist()
    assert got[3] == 5 and got[4] == 7 and got[5] == 0 and got[6] == 0
    assert ops.argmax_rows(torch.randn(1, 1)) == [0]
    with pytest.raises(RuntimeError, match="argmax_rows"):
        ops.argmax_rows(logits.t())  # not contiguous
    with pytest.raises(RuntimeError, match="argmax_rows"):
        ops.argmax_rows(logits.double())

import torch
import torch.nn.functional as F

from tokenflow_ray.tokenizer.config import QuantizerConfig
from tokenflow_ray.tokenizer.multiscale import MultiScaleQuantizer, scales_for_grid
from tokenflow_ray.tokenizer.quantizer import l2n


def _smooth_maps(n=8, side=8):
    g = torch.Generator().manual_seed(1)
    coarse = torch.randn(n, 4, 3, 3, generator=g)
    fine = torch.randn(n, 4, side, side, generator=g)
    return F.interpolate(coarse, size=(side, side), mode="bicubic") + 0.3 * fine


def _fit(mq: MultiScaleQuantizer, z, steps=150):
    opt = torch.optim.Adam(mq.parameters(), lr=0.05)
    for _ in range(steps):
        out = mq(z[:, :2], z[:, 2:])
        opt.zero_grad()
        out.vq_loss.backward()
        opt.step()
    return mq.eval()


def test_more_scales_reconstruct_better_var_variant():
    torch.manual_seed(0)
    cfg = QuantizerConfig(codebook_size=64, sem_dim=2, pix_dim=2, usage_window=64, residual="var")
    mq = _fit(MultiScaleQuantizer(cfg, (1, 2, 4, 8), scale_drop_prob=0.0), _smooth_maps())
    z = _smooth_maps()
    f = torch.cat([l2n(z[:, :2], dim=1), l2n(z[:, 2:], dim=1)], 1)
    with torch.no_grad():
        idx = mq(z[:, :2], z[:, 2:]).idx_per_scale
        errs = [F.mse_loss(mq.indices_to_fhat(idx[:k], 8), f).item() for k in range(1, 5)]
    assert all(a > b for a, b in zip(errs, errs[1:])), errs  # every added scale lowers the residual error
    assert errs[-1] < 0.5 * errs[0], errs


def test_single_scale_is_plain_straight_through_vq():
    cfg = QuantizerConfig(codebook_size=32, sem_dim=3, pix_dim=2)
    mq = MultiScaleQuantizer(cfg, (4,), scale_drop_prob=0.0)
    z_sem, z_pix = torch.randn(2, 3, 4, 4, requires_grad=True), torch.randn(2, 2, 4, 4, requires_grad=True)
    out = mq(z_sem, z_pix)
    (idx,) = out.idx_per_scale
    codes = mq.codebook.lookup(idx).movedim(-1, 1)
    assert torch.allclose(out.f_hat_BCHW, codes, atol=1e-6)  # forward value: exactly the unit codewords
    f = torch.cat([l2n(z_sem, dim=1), l2n(z_pix, dim=1)], 1)
    assert torch.allclose(out.codebook_loss, F.mse_loss(codes, f.detach()))
    out.f_hat_BCHW.sum().backward()
    assert z_sem.grad.abs().sum() > 0 and z_pix.grad.abs().sum() > 0  # straight-through to both inputs


def test_scale_drop_skips_one_non_first_scale_in_training_only():
    cfg = QuantizerConfig(codebook_size=16, sem_dim=2, pix_dim=2)
    mq = MultiScaleQuantizer(cfg, (1, 2, 4), scale_drop_prob=1.0)
    z = torch.randn(1, 4, 4, 4)
    used = mq(z[:, :2], z[:, 2:]).scales
    assert len(used) == 2 and used[0] == 1 and used[-1] in (2, 4)
    assert mq.eval()(z[:, :2], z[:, 2:]).scales == (1, 2, 4)
    assert MultiScaleQuantizer(cfg, (1, 2, 4), 0.0)(z[:, :2], z[:, 2:]).scales == (1, 2, 4)


def test_beta_scales_the_commitment_term():
    z = torch.randn(1, 4, 2, 2)
    outs = []
    for beta in (0.25, 1.0):
        torch.manual_seed(0)
        mq = MultiScaleQuantizer(QuantizerConfig(codebook_size=8, sem_dim=2, pix_dim=2, beta=beta), (2,), 0.0)
        outs.append(mq(z[:, :2], z[:, 2:]))
    assert torch.allclose(outs[0].vq_loss, outs[0].codebook_loss + 0.25 * outs[0].commit_loss)
    assert torch.allclose(outs[1].vq_loss, outs[1].codebook_loss + 1.0 * outs[1].commit_loss)


def test_scales_for_other_grids_follow_infer_interpolate():
    assert scales_for_grid((1, 2, 4, 6, 8, 10, 12, 14), 16) == (1, 2, 4, 6, 8, 10, 12, 14, 16)
    assert scales_for_grid((1, 2, 4, 6, 8, 10, 12, 14), 7) == (1, 2, 4, 6, 7)


def test_official_residual_normalises_and_scores_each_scale():
    """The official variant: each scale's downsampled residual is unit per branch before its search, the VQ loss is
    the mean over scales of that scale's (codeword, normalised residual) error, codewords add with weight 1."""
    torch.manual_seed(0)
    cfg = QuantizerConfig(codebook_size=64, sem_dim=2, pix_dim=2, usage_window=64)
    assert cfg.residual == "official"
    mq = MultiScaleQuantizer(cfg, (1, 2, 4), scale_drop_prob=0.0)
    assert not hasattr(mq, "gain_S2")
    z = _smooth_maps(side=4).requires_grad_(True)
    out = mq(z[:, :2], z[:, 2:])
    h, expect_cb, total = z.detach(), 0.0, torch.zeros_like(z)
    for side, idx in zip(out.scales, out.idx_per_scale):
        rest = F.interpolate(h, size=(side, side), mode="area")
        z_n = torch.cat([l2n(rest[:, :2], dim=1), l2n(rest[:, 2:], dim=1)], 1)
        q = mq.codebook.lookup(idx).movedim(-1, 1)
        expect_cb += F.mse_loss(q, z_n) / 3
        up = q if side == 4 else F.interpolate(q, size=(4, 4), mode="bicubic")
        total, h = total + up, h - up
    assert torch.allclose(out.codebook_loss, torch.as_tensor(expect_cb), atol=1e-6)
    assert torch.allclose(out.f_hat_BCHW, total, atol=1e-5)
    assert torch.allclose(mq.indices_to_fhat(out.idx_per_scale, 4), total, atol=1e-5)  # indices alone decode
    out.f_hat_BCHW.sum().backward()
    assert z.grad.abs().sum() > 0

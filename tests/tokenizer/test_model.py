import dataclasses

import pytest
import torch

from tokenflow_ray.tokenizer.config import LossConfig, QuantizerConfig, TokenizerConfig, preset
from tokenflow_ray.tokenizer.criterion import TokenizerLoss
from tokenflow_ray.tokenizer.discriminator import PatchDiscriminator
from tokenflow_ray.tokenizer.losses import discriminator_loss
from tokenflow_ray.tokenizer.model import DualCodebookTokenizer


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return DualCodebookTokenizer(preset("tiny"))


@pytest.fixture(scope="module")
def crit(tiny):
    return TokenizerLoss.for_model(tiny)


def _imgs(n=2, side=16):
    return torch.rand(n, 3, side, side) * 2 - 1


def _grad_norm(module):
    return sum(p.grad.abs().sum().item() for p in module.parameters() if p.grad is not None)


def test_straight_through_gradients_reach_both_encoders(tiny, crit):
    tiny.zero_grad()
    out = crit(tiny, _imgs())
    out.mse_loss.backward(retain_graph=True)  # pixel loss alone: must pass the quantiser to the pixel encoder
    assert _grad_norm(tiny.pix_encoder) > 0
    assert _grad_norm(tiny.sem_encoder) == 0
    tiny.zero_grad()
    out.sem_loss.backward()  # semantic loss alone: must pass the quantiser to the semantic tower and head
    assert _grad_norm(tiny.sem_encoder.tower) > 0 and _grad_norm(tiny.sem_encoder.head) > 0
    assert all(p.grad is None for p in crit.teacher.parameters())  # the teacher stays frozen
    tiny.zero_grad()


def test_forward_total_is_the_weighted_sum(tiny, crit):
    out = crit(tiny, _imgs())
    lc = tiny.config.loss
    expected = lc.sem_weight * out.sem_loss + lc.vq_weight * out.vq_loss + lc.mse_weight * out.mse_loss
    assert torch.allclose(out.loss, expected)  # tiny has LPIPS off; no discriminator given
    assert 0 < out.usage <= 1


@pytest.mark.parametrize("side", [8, 16, 32])
def test_encode_decode_shapes_across_resolutions(tiny, side):
    enc = tiny.encode(_imgs(3, side))
    grid = side // 4
    assert enc.idx_per_scale[-1].shape == (3, grid, grid)
    assert enc.scales[-1] == grid
    assert tiny.decode(enc.idx_per_scale).shape == (3, 3, side, side)
    assert tiny.indices_to_semantic(enc.idx_per_scale).shape == (3, 24, grid, grid)


def test_encode_is_deterministic_and_leaves_train_mode(tiny):
    tiny.train()
    x = _imgs()
    a, b = tiny.encode(x), tiny.encode(x)
    assert all(torch.equal(i, j) for i, j in zip(a.idx_per_scale, b.idx_per_scale))
    assert tiny.training


def test_save_load_round_trip_is_exact(tiny, crit, tmp_path):
    crit(tiny, _imgs())  # populate the usage window so buffers are non-trivial
    tiny.save_pretrained(tmp_path)
    loaded = DualCodebookTokenizer.from_pretrained(tmp_path)
    # The tokenizer only: the teacher and the perceptual network live in the loss module.
    assert not [k for k in tiny.state_dict() if k.startswith(("teacher", "lpips")) or ".teacher." in k]
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(tiny.state_dict())
    assert loaded.config == tiny.config
    sd_a, sd_b = tiny.state_dict(), loaded.state_dict()
    assert sd_a.keys() == sd_b.keys() and all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a)
    x = _imgs()
    ea, eb = tiny.encode(x), loaded.encode(x)
    assert all(torch.equal(i, j) for i, j in zip(ea.idx_per_scale, eb.idx_per_scale))
    assert torch.equal(tiny.decode(ea.idx_per_scale), loaded.decode(eb.idx_per_scale))


@pytest.mark.parametrize("bad,match", [
    (torch.rand(1, 4, 16, 16), "3 channels"),
    (torch.rand(1, 3, 18, 18), "not divisible"),
    (torch.rand(1, 3, 16, 12), "square"),
    (torch.full((1, 3, 16, 16), float("nan")), "NaN"),
    (torch.rand(3, 16, 16), "4-d"),
])
def test_bad_images_raise_clear_errors(tiny, bad, match):
    with pytest.raises(ValueError, match=match):
        tiny.encode(bad)


def test_out_of_range_indices_raise(tiny):
    enc = tiny.encode(_imgs())
    bad = list(enc.idx_per_scale)
    bad[-1] = bad[-1].clone()
    bad[-1][0, 0, 0] = tiny.config.quantizer.codebook_size
    with pytest.raises(ValueError, match="codebook size"):
        tiny.decode(bad)


def test_separate_mode_tokens_and_decode():
    cfg = preset("tiny", quantizer=dataclasses.replace(preset("tiny").quantizer, index_mode="separate"))
    m = DualCodebookTokenizer(cfg)
    enc = m.encode(_imgs())
    assert enc.idx_per_scale[-1].shape == (2, 4, 4, 2)
    assert m.decode(enc.idx_per_scale).shape == (2, 3, 16, 16)


def test_w_dis_knob_changes_the_tokens():
    base = preset("tiny")
    toks = []
    for w in (0.0, 100.0):
        torch.manual_seed(0)
        m = DualCodebookTokenizer(dataclasses.replace(base, quantizer=dataclasses.replace(base.quantizer, w_dis=w)))
        toks.append(m.encode(_imgs(4)).idx_per_scale[-1])
    assert not torch.equal(toks[0], toks[1])


def test_gan_term_starts_at_its_step_and_discriminator_has_its_own_loss():
    cfg = preset("tiny")
    cfg = dataclasses.replace(cfg, loss=dataclasses.replace(cfg.loss, gan_start_step=10))
    m, disc = DualCodebookTokenizer(cfg), PatchDiscriminator(ndf=8, n_layers=2)
    c = TokenizerLoss.for_model(m)
    x = _imgs()
    assert c(m, x, step=9, discriminator=disc).gan_loss.item() == 0
    out = c(m, x, step=10, discriminator=disc)
    assert out.gan_loss.item() != 0
    d = discriminator_loss(disc, x, out.recon_BCHW)
    d.loss.backward()
    assert _grad_norm(disc) > 0 and _grad_norm(m.pix_decoder) == 0  # D's step never reaches the generator


def test_presets_are_consistent_without_building_models():
    xl = preset("tokenflow-xl")
    assert xl.grid == 27 and xl.grid * xl.pixel.downsample == 432 and xl.side_multiple == 128
    b = preset("tokenflow-b")
    assert b.grid == 14 and b.quantizer.codebook_size == 32768 and b.side_multiple == 16
    with pytest.raises(ValueError, match="unknown tokenizer preset"):
        preset("nope")


@pytest.mark.parametrize("change,match", [
    ({"scales": (1, 2, 3)}, "last scale"),
    ({"scales": (2, 1, 4)}, "strictly increasing"),
    ({"scale_drop_prob": 1.5}, "scale_drop_prob"),
    ({"quantizer": QuantizerConfig(sem_dim=16)}, "sem_dim"),
])
def test_root_config_validation(change, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(preset("tiny"), **change)


def test_loss_config_validation():
    with pytest.raises(ValueError, match="mse_weight"):
        LossConfig(mse_weight=-1.0)


def test_config_dict_round_trip_and_unknown_keys():
    cfg = preset("tokenflow-xl")
    assert TokenizerConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown"):
        TokenizerConfig.from_dict({"bogus": 1})


def test_tower_geometry_mismatch_is_refused(tiny, tmp_path):
    import json

    tiny.save_pretrained(tmp_path)
    meta = json.loads((tmp_path / "config.json").read_text())
    meta["semantic_tower"]["patch_size"] = 8
    (tmp_path / "config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="patch_size 8 but the config says semantic.patch_size 4"):
        DualCodebookTokenizer.from_pretrained(tmp_path)


def test_pretrained_tower_geometry_is_checked(tmp_path):
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    sem = preset("tiny").semantic
    CLIPVisionModelWithProjection(CLIPVisionConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                   intermediate_size=64, image_size=32, patch_size=4,
                                                   projection_dim=sem.feature_dim)).save_pretrained(tmp_path)
    cfg = preset("tiny", semantic=dataclasses.replace(sem, pretrained_path=str(tmp_path)))
    with pytest.raises(ValueError, match="image_size 32, the config semantic.image_size 16"):
        DualCodebookTokenizer(cfg)

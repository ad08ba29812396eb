"""LPIPS reference network and the shared reconstruction metrics, with weights the tests write themselves."""

import pytest
import torch

from tokenflow_ray.tokenizer import image_metrics
from tokenflow_ray.tokenizer.perceptual import LPIPS, load_lpips


@pytest.fixture(scope="module")
def lpips_file(tmp_path_factory):
    torch.manual_seed(0)
    net = LPIPS()
    for lin in net.lins:  # the real lin weights are non-negative; so are these
        lin.model[1].weight.data.abs_()
    path = tmp_path_factory.mktemp("lpips") / "lpips_vgg.pt"
    torch.save(net.state_dict(), path)
    return path


def test_state_dict_has_the_lpips_package_names(lpips_file):
    keys = set(torch.load(lpips_file, weights_only=True))
    # lpips.LPIPS(net="vgg") names: torchvision's vgg16 feature indices inside 5 slices, then lin0..lin4.
    for key in ("net.slice1.0.weight", "net.slice2.5.weight", "net.slice5.28.bias", "lin0.model.1.weight",
                "lin4.model.1.weight", "scaling_layer.shift"):
        assert key in keys
    # The package's shipped file holds only lin{i}.model.1.weight; that subset (plus a backbone) must load too.
    partial = {k: v for k, v in torch.load(lpips_file, weights_only=True).items() if not k.startswith("lins.")}
    torch.save(partial, lpips_file.parent / "partial.pt")
    load_lpips(lpips_file.parent / "partial.pt")


def test_distance_is_zero_on_itself_positive_otherwise_and_differentiable(lpips_file):
    net = load_lpips(lpips_file)
    x = torch.rand(2, 3, 16, 16) * 2 - 1
    y = (x + 0.3 * torch.randn_like(x)).clamp(-1, 1).requires_grad_(True)
    assert torch.allclose(net(x, x), torch.zeros(2, 1, 1, 1), atol=1e-6)
    d = net(x, y)
    assert d.shape == (2, 1, 1, 1) and (d > 0).all()
    d.sum().backward()
    assert y.grad.abs().sum() > 0 and all(p.grad is None for p in net.parameters())  # frozen
    net.train()
    assert not net.training  # dropout in the lin layers can never switch on


def test_missing_or_wrong_file_is_a_one_line_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="LPIPS weights not found"):
        load_lpips(tmp_path / "nope.pt")
    torch.save({"foo": torch.zeros(1)}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="do not fit the VGG16 LPIPS network"):
        load_lpips(tmp_path / "bad.pt")


def test_psnr_ssim_shared_definitions():
    x = torch.rand(3, 3, 16, 16) * 2 - 1
    noisy = (x + 0.1 * torch.randn_like(x)).clamp(-1, 1)
    p = image_metrics.psnr(noisy, x)
    mse = (((noisy - x) / 2) ** 2).flatten(1).mean(1)
    assert torch.allclose(p, 10 * torch.log10(1 / mse), atol=1e-4)
    s = image_metrics.ssim(noisy, x)
    assert s.shape == (3,) and (s < 1).all() and torch.allclose(image_metrics.ssim(x, x), torch.ones(3), atol=1e-5)


def test_rfid_over_a_local_feature_network(tmp_path):
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    torch.manual_seed(0)
    CLIPVisionModelWithProjection(CLIPVisionConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                   intermediate_size=64, image_size=32, patch_size=8,
                                                   projection_dim=16)).save_pretrained(tmp_path / "feat")
    x = torch.rand(40, 3, 16, 16) * 2 - 1
    same, other = image_metrics.RFID(tmp_path / "feat"), image_metrics.RFID(tmp_path / "feat")
    same.update(x, x)
    other.update(x, -x)
    assert abs(same.compute()) < 1e-3 and other.compute() > 1e-3
    with pytest.raises(FileNotFoundError, match="FID feature network not found"):
        image_metrics.RFID(tmp_path / "missing")

"""LPIPS (Zhang et al. 2018, v0.1, VGG16 backbone): the reference network, loaded from a local state dict.

The module tree and parameter names are those of the `lpips` package's `LPIPS(net="vgg", version="0.1")`
(`net.slice1.0.weight` ... `net.slice5.28.weight`, `lin0.model.1.weight` ... `lin4.model.1.weight`), so its
state dict loads here unchanged. Why not import the package: it imports torchvision, whose registry wheels are CUDA
builds that fail to load against the CPU torch this project installs (`operator torchvision::nms does not exist`).
The forward pass is the package's: scaling layer on [-1, 1] input, per layer unit-normalised channels, squared
difference, a learned 1x1 weighting, spatial mean, summed over the five layers.

Weights are never downloaded. To make the file once on a machine with the `lpips` package (and its torchvision):
    python -c "import lpips, torch; torch.save(lpips.LPIPS(net='vgg').state_dict(), 'lpips_vgg.pt')"
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

# torchvision vgg16().features as (kind, out_channels); slices end after relu1_2, relu2_2, relu3_3, relu4_3, relu5_3.
_VGG16 = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512]
_SLICE_ENDS = (4, 9, 16, 23, 30)  # exclusive layer indices into vgg16().features, as in lpips.pretrained_networks
CHANNELS = (64, 128, 256, 512, 512)


def _vgg_layers() -> list[nn.Module]:
    layers, c_in = [], 3
    for v in _VGG16:
        if v == "M":
            layers.append(nn.MaxPool2d(2, 2))
        else:
            layers += [nn.Conv2d(c_in, v, 3, padding=1), nn.ReLU(inplace=False)]
            c_in = v
    return layers


class VGG16Slices(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layers, start = _vgg_layers(), 0
        for i, end in enumerate(_SLICE_ENDS):
            s = nn.Sequential()
            for j in range(start, end):
                s.add_module(str(j), layers[j])  # torchvision's indices, so the state-dict keys match
            setattr(self, f"slice{i + 1}", s)
            start = end

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        out = []
        for i in range(len(_SLICE_ENDS)):
            x = getattr(self, f"slice{i + 1}")(x)
            out.append(x)
        return out


class ScalingLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("shift", torch.tensor([-.030, -.088, -.188])[None, :, None, None])
        self.register_buffer("scale", torch.tensor([.458, .448, .450])[None, :, None, None])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.shift) / self.scale


class NetLinLayer(nn.Module):
    def __init__(self, c_in: int) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Dropout(), nn.Conv2d(c_in, 1, 1, bias=False))


def _unit(x: torch.Tensor, eps: float = 1e-10) -> torch.Tensor:
    return x / (x.pow(2).sum(dim=1, keepdim=True).sqrt() + eps)


class LPIPS(nn.Module):
    """d(x, y) per image, B x 1 x 1 x 1, for images in [-1, 1]. Frozen: it is a loss, not a trained part."""

    def __init__(self) -> None:
        super().__init__()
        self.scaling_layer = ScalingLayer()
        self.net = VGG16Slices()
        for i, c in enumerate(CHANNELS):
            setattr(self, f"lin{i}", NetLinLayer(c))
        self.lins = nn.ModuleList([getattr(self, f"lin{i}") for i in range(len(CHANNELS))])

    def train(self, mode: bool = True) -> LPIPS:
        return super().train(False)  # why: the lin layers' dropout must never be active

    def forward(self, x_BCHW: torch.Tensor, y_BCHW: torch.Tensor) -> torch.Tensor:
        fx, fy = self.net(self.scaling_layer(x_BCHW)), self.net(self.scaling_layer(y_BCHW))
        total = 0
        for lin, a, b in zip(self.lins, fx, fy):
            total = total + lin.model((_unit(a) - _unit(b)) ** 2).mean(dim=(2, 3), keepdim=True)
        return total


def load_lpips(path: str | Path) -> LPIPS:
    """The reference network with the weights at `path` (a torch state dict); one-line errors for a missing or
    incompatible file."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"LPIPS weights not found: {file} (model.loss.lpips_path; weights are read from a "
                                "local file, never downloaded)")
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, ValueError, EOFError) as exc:
        raise ValueError(f"LPIPS weights at {file} cannot be read: {type(exc).__name__}") from None
    state = state.get("state_dict", state) if isinstance(state, dict) else state
    module = LPIPS()
    if not isinstance(state, dict):
        raise ValueError(f"LPIPS weights at {file} are not a state dict")
    # The package's file carries each lin layer twice (lin{i}.* and lins.{i}.*); either copy is enough.
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith("lins.") and not k.startswith("scaling_layer.")]
    if missing or unexpected:
        raise ValueError(f"LPIPS weights at {file} do not fit the VGG16 LPIPS network (missing {missing[:3]}, "
                         f"unexpected {list(unexpected)[:3]})")
    return module.eval().requires_grad_(False)

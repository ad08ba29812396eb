"""PackedLinear: a linear layer whose weight is reordered once into oneDNN's blocked layout.

`torch.ops.mkldnn._linear_pointwise` on a weight from `_reorder_linear_weight` takes and returns ordinary dense
tensors, so there is no per-call conversion of activations (which `torch.utils.mkldnn.to_mkldnn` modules pay), and
oneDNN's AVX-512 kernels run at close to the core's FMA peak where the default BLAS path may not (on AMD CPUs MKL
takes an AVX2 path). The engine benchmark and `bench/roofline.py` measure both.
"""

from __future__ import annotations

import torch
from torch import nn


def onednn_linear_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise") and \
        hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, batch_hint: int | None = None) -> None:
        super().__init__()
        weight = linear.weight.detach()
        # The hint only picks the packing format; any number of rows works at run time.
        args = (weight,) if batch_hint is None else (weight, batch_hint)
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(*args), persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone(), persistent=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._bind()

    def _bind(self) -> None:
        # The op and both tensors as plain attributes: a decode step makes 25 of these calls, and the module's
        # __getattr__ for each buffer and the torch.ops namespace lookups cost more than the call's Python.
        # Rebound whenever the buffers are replaced (`_apply`: .to(), .cpu(), ...).
        self.__dict__["_call"] = (torch.ops.mkldnn._linear_pointwise, self.packed_weight, self.bias)

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self._bind()
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        op, weight, bias = self._call
        return op(x, weight, bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(module: nn.Module, names: tuple[str, ...], batch_hint: int | None = None) -> None:
    for name in names:
        setattr(module, name, PackedLinear(getattr(module, name), batch_hint))

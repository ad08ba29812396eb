"""PackedLinear: a linear layer whose weight is reordered once for the CPU GEMM that runs it (fp32).

Two kernels, each taking and returning ordinary dense tensors (no per-call conversion of activations):
- "tokenflow": the compiled panel GEMM (layers/csrc/packed_gemm.cpp). On this project's AVX-512 box it beat oneDNN
  at every batch size measured (1 to 2048 rows), above all at decode sizes, where oneDNN's fixed cost a call and its
  waits on weights from DRAM dominate. The default where the CPU has AVX-512 (a 16-lane build).
- "onednn": `torch.ops.mkldnn._linear_pointwise` on a weight from `_reorder_linear_weight`: oneDNN's AVX-512/AVX2
  kernels, at close to the core's FMA peak for large products (on AMD CPUs MKL takes an AVX2 path). The default on
  AVX2-only CPUs: with every layer held to AVX2 the panel GEMM tied it in a step at batch 32 and trailed at 64.
`lab/roofline.py` measures oneDNN's rate; `tokenflow bench engine` the model with whichever kernel runs it.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenflow_ray.engine.config import CPU_GEMMS


def onednn_linear_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise") and \
        hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def _packed_gemm():
    """The compiled panel GEMM (built once per machine, loaded once per process), or None."""
    from tokenflow_ray.layers.cpu_kernels import load_packed_gemm

    return load_packed_gemm()


def resolve_cpu_gemm(name: str = "auto") -> str | None:
    """The kernel `name` stands for on this machine: "tokenflow", "onednn", or None (neither: keep nn.Linear).
    A named kernel that cannot run here falls back to the other one."""
    if name not in CPU_GEMMS:
        raise ValueError(f"cpu_gemm: expected one of {CPU_GEMMS}, got {name!r}")
    if name != "onednn":
        gemm = _packed_gemm()
        if gemm is not None and (name == "tokenflow" or gemm.lanes() == 16):
            return "tokenflow"
    if onednn_linear_available():
        return "onednn"
    return "tokenflow" if _packed_gemm() is not None else None


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, kernel: str = "onednn", batch_hint: int | None = None) -> None:
        super().__init__()
        if kernel not in ("tokenflow", "onednn"):
            raise ValueError(f"kernel: tokenflow or onednn, got {kernel!r}")
        weight = linear.weight.detach()
        self.kernel = kernel
        if kernel == "tokenflow":
            gemm = _packed_gemm()
            if gemm is None:
                raise RuntimeError("the packed GEMM kernel did not build here (see the log); use kernel='onednn'")
            packed = gemm.pack(weight.float().contiguous())
        else:
            # The hint only picks the packing format; any number of rows works at run time.
            args = (weight,) if batch_hint is None else (weight, batch_hint)
            packed = torch.ops.mkldnn._reorder_linear_weight(*args)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone(), persistent=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._bind()

    def _bind(self) -> None:
        # The op and both tensors as plain attributes: a decode step makes 25 of these calls, and the module's
        # __getattr__ for each buffer and the torch.ops namespace lookups cost more than the call's Python.
        # Rebound whenever the buffers are replaced (`_apply`: .to(), .cpu(), ...).
        op = _packed_gemm().linear if self.kernel == "tokenflow" else torch.ops.mkldnn._linear_pointwise
        self.__dict__["_call"] = (op, self.packed_weight, self.bias)

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self._bind()
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        op, weight, bias = self._call
        if self.kernel == "tokenflow":
            return op(x, weight, self.out_features, bias)
        return op(x, weight, bias, "none", [], "")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"kernel={self.kernel}")


def pack_linears(module: nn.Module, names: tuple[str, ...], kernel: str = "onednn",
                 batch_hint: int | None = None) -> None:
    for name in names:
        setattr(module, name, PackedLinear(getattr(module, name), kernel, batch_hint))

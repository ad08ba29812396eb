"""TOKENFLOW_KERNEL_MARCH: the CPU kernels built for a named target (one build for a cluster's mixed CPUs, or the
AVX2 path measured on an AVX-512 box), cached under the target's name; a bad name is a clear error."""

from __future__ import annotations

import re

import pytest
import torch

from tokenflow_ray.lab.engine_bench import isa_in_use, machine_info
from tokenflow_ray.layers import cpu_kernels
from tokenflow_ray.layers.cpu_kernels import GEMM_SOURCE, MARCH_ENV, compiler_available, kernel_march


def test_native_by_default_and_tagged_by_this_cpus_flags(monkeypatch):
    monkeypatch.delenv(MARCH_ENV, raising=False)
    assert kernel_march() == "native"
    assert re.fullmatch(r"[0-9a-f]{8}", cpu_kernels._cpu_tag())
    monkeypatch.setenv(MARCH_ENV, "  ")
    assert kernel_march() == "native"


def test_a_named_target_is_its_own_cache_tag(monkeypatch):
    monkeypatch.setenv(MARCH_ENV, "x86-64-v3")
    assert kernel_march() == "x86-64-v3" and cpu_kernels._cpu_tag() == "x86_64_v3"


@pytest.mark.parametrize("bad", ["native -O0", "x86-64-v3;true", "$(id)"])
def test_a_bad_target_is_refused_by_name(monkeypatch, bad):
    monkeypatch.setenv(MARCH_ENV, bad)
    with pytest.raises(ValueError, match=MARCH_ENV):
        kernel_march()


def test_the_engine_bench_records_what_its_kernels_were_allowed(monkeypatch):
    monkeypatch.setenv(MARCH_ENV, "x86-64-v3")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    isa = isa_in_use()
    assert isa == {"aten_cpu_capability": torch.backends.cpu.get_cpu_capability(), "onednn_max_cpu_isa": "AVX2",
                   "kernel_march": "x86-64-v3"}
    assert machine_info().items() >= isa.items()


@pytest.mark.skipif(not compiler_available(), reason="needs a C++ compiler")
def test_an_x86_64_v3_build_is_the_8_lane_gemm_and_computes_the_same(monkeypatch):
    """Built for x86-64-v3 (AVX2, no AVX-512) the GEMM takes 8-float vectors whatever this CPU has."""
    if not re.search(r"\bavx2\b", open("/proc/cpuinfo").read()):
        pytest.skip("the build would not run on this CPU")
    monkeypatch.setenv(MARCH_ENV, "x86-64-v3")
    gemm = cpu_kernels._build("tokenflow_packed_gemm", GEMM_SOURCE, "the packed GEMM")
    assert gemm is not None and gemm.lanes() == 8
    torch.manual_seed(3)
    x, w, b = torch.randn(13, 200), torch.randn(70, 200), torch.randn(70)
    torch.testing.assert_close(gemm.linear(x, gemm.pack(w), 70, b), torch.nn.functional.linear(x, w, b),
                               rtol=1e-5, atol=1e-4)

"""Part `attention`: every attention backend the device has, by name, against SDPA on the same device and against
the float64 CPU reference, in fp32 and bf16, on decode, prefill, chunked prefill and mixed paged batches.

A backend is asked for through `select_backend` by its name; one that is not there (not installed, not merged
yet, not for this device) is recorded `unavailable` with the reason, so a backend added later (triton) is picked
up without a change here. Also checked: the step's K/V written into the pool exactly (the write is a copy).
"""

from __future__ import annotations

import torch

from tokenflow_ray.lab.gpu.context import PartContext
from tokenflow_ray.lab.gpu.paged_cases import case_specs, cast, make_case, metadata, reference
from tokenflow_ray.layers.attention_select import select_backend

BACKENDS = ("sdpa", "cpu_paged", "flash", "triton")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Max abs error against the float64 reference on unit-normal inputs: fp32 arithmetic (TF32 matmuls included)
# lands well under the first, bf16 under the second.
TOLERANCE = {"float32": 2e-3, "bfloat16": 3e-2}


def _backend(name: str, device: torch.device, block_size: int, dtype: torch.dtype, dry: bool):
    """The backend object, or the reason there is none."""
    if dry and name == "cpu_paged":  # a dry run builds no C++ kernel (tests/runner covers it)
        return None, "the dry run builds no CPU kernel (tests/runner/test_backends.py covers cpu_paged)"
    try:
        backend = select_backend(device, block_size, name, dtype)
    except (ValueError, ImportError, RuntimeError) as exc:
        return None, f"{type(exc).__name__}: {exc}"
    if backend.name != name:
        return None, f"select_backend({name!r}) gave {backend.name!r}"
    return backend, None


def _run(backend, case, device, dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = cast(case, device, dtype)
    meta = metadata(case, backend.name, device)
    out = backend.forward(x["q"], x["k"], x["v"], x["k_cache"], x["v_cache"], meta)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out.view(x["q"].shape).cpu().double(), x["k_cache"].cpu().double(), x["v_cache"].cpu().double()


def _compare(backend, case, expected, sdpa_out, device, dtype) -> dict:
    """One backend on one case: its output against the reference and SDPA's, its KV write against the reference's."""
    ref, ref_k, ref_v = expected
    try:
        out, k_pool, v_pool = _run(backend, case, device, dtype)
    except Exception as exc:  # one backend's failure is its result, not the part's
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"max_abs_vs_reference": (out - ref).abs().max().item(),
            "max_abs_vs_sdpa": (out - sdpa_out).abs().max().item(),
            "kv_write_exact": bool(torch.equal(k_pool, ref_k.to(dtype).double())
                                   and torch.equal(v_pool, ref_v.to(dtype).double())),
            "finite": bool(torch.isfinite(out).all())}


def _passes(result: dict, tolerance: float) -> bool:
    return "error" not in result and result["finite"] and result["kv_write_exact"] \
        and result["max_abs_vs_reference"] <= tolerance


def run(ctx: PartContext) -> None:
    device = ctx.device()
    dims, specs = case_specs(ctx.mode)
    ctx.save("device", str(device))
    ctx.save("shape", {"block_size": dims.block_size, "heads": dims.heads, "kv_heads": dims.kv_heads,
                       "head_dim": dims.head_dim, "cases": {s.name: {"decode_lens": list(s.decode_lens),
                                                                     "chunks": [list(c) for c in s.chunks]}
                                                            for s in specs}})
    results: dict = {}
    cases = [make_case(spec, dims, seed=i) for i, spec in enumerate(specs)]
    for dtype_name, dtype in DTYPES.items():
        expected = [reference(c, dtype) for c in cases]
        sdpa = select_backend(device, dims.block_size, "sdpa", dtype)
        sdpa_outs = [_run(sdpa, c, device, dtype)[0] for c in cases]
        for name in BACKENDS:
            key = f"{name}/{dtype_name}"
            backend, reason = _backend(name, device, dims.block_size, dtype, ctx.dry)
            if backend is None:
                results[key] = {"status": "unavailable", "reason": reason}
            else:
                per_case = {c.spec.name: _compare(backend, c, e, o, device, dtype)
                            for c, e, o in zip(cases, expected, sdpa_outs)}
                ok = all(_passes(r, TOLERANCE[dtype_name]) for r in per_case.values())
                results[key] = {"status": "ok" if ok else "mismatch", "backend": backend.name,
                                "tolerance": TOLERANCE[dtype_name], "cases": per_case}
            ctx.save("backends", results)
    worst = {k: max(c.get("max_abs_vs_reference", float("nan")) for c in r["cases"].values())
             for k, r in results.items() if "cases" in r}
    unavailable = [k for k, r in results.items() if r["status"] == "unavailable"]
    ctx.save("headline", "max abs vs fp64 reference: " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items())
             + f"; mismatch: {[k for k, r in results.items() if r['status'] == 'mismatch'] or 'none'}"
             + f"; unavailable: {', '.join(unavailable) or 'none'}")

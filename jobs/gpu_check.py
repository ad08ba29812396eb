"""One short device check for a CUDA machine: `python jobs/gpu_check.py --json out.json` (not part of CI)."""

from __future__ import annotations

import argparse
import json

import torch

from tokenflow_ray.runner.attention import SdpaPagedAttention, flash_attn_available
from tokenflow_ray.runner.gpu_check import (
    copy_overlap,
    kv_copy_overlap,
    kv_transfer_roundtrip,
    llama8b_step_time,
    paged_attention_parity,
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device")
    out: dict = {"device": torch.cuda.get_device_name(), "flash_attn": flash_attn_available()}
    if out["flash_attn"]:
        from tokenflow_ray.runner.attention import FlashPagedAttention

        out["flash_vs_sdpa_max_abs"] = paged_attention_parity(FlashPagedAttention(), SdpaPagedAttention())
    out["sdpa_cuda_vs_cpu_max_abs"] = _sdpa_cuda_vs_cpu()
    out["kv_transfer_roundtrip"] = kv_transfer_roundtrip()
    out["copy_overlap"] = copy_overlap()
    out["kv_copy_overlap"] = kv_copy_overlap()  # KVTransfer's evict/load streams beside compute
    out["llama8b_sdpa"] = llama8b_step_time(backend="sdpa")
    if out["flash_attn"]:
        out["llama8b_flash"] = llama8b_step_time(backend="flash")
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


def _sdpa_cuda_vs_cpu() -> float:
    """The torch fallback on CUDA against the same code on CPU (float32), on one paged batch."""
    from tokenflow_ray.runner.gpu_check import _random_paged_batch

    batch_gpu = _random_paged_batch(torch.device("cuda"), torch.float32)
    batch_cpu = [x.cpu() if isinstance(x, torch.Tensor) else x for x in batch_gpu[:5]]
    meta = batch_gpu[5]
    meta_cpu = type(meta)(**{k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in meta.__dict__.items()})
    meta_cpu.prefills = [type(p)(p.start, p.end, p.start_pos, p.block_table.cpu()) for p in meta.prefills]
    a = SdpaPagedAttention().forward(*batch_gpu[:5], meta)
    b = SdpaPagedAttention().forward(*batch_cpu, meta_cpu)
    return float((a.cpu() - b).abs().max())


if __name__ == "__main__":
    main()

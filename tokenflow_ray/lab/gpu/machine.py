"""The machine and the code a bench ran on: GPU, driver, library versions, the commit.

Read without starting CUDA in the orchestrator (nvidia-smi for the GPU, package metadata for the versions), so the
parts' processes have the device to themselves.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import subprocess
from pathlib import Path

_SMI_FIELDS = ("name", "driver_version", "memory.total", "clocks.max.sm")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def gpus() -> list[dict] | str:
    """nvidia-smi's view of each GPU, or why there is none."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(_SMI_FIELDS)}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"nvidia-smi: {type(exc).__name__}: {exc}"
    if out.returncode != 0:
        return f"nvidia-smi exited {out.returncode}: {out.stderr.strip()[:200]}"
    return [dict(zip(_SMI_FIELDS, (v.strip() for v in line.split(",")))) for line in out.stdout.splitlines()
            if line.strip()]


def machine_facts() -> dict:
    import torch  # imported, not started: torch.version needs no device

    return {
        "gpus": gpus(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "numpy": _version("numpy"),
        "flash_attn": importlib.util.find_spec("flash_attn") is not None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
    }


def git_commit(root: Path, given: str | None = None) -> dict:
    """`git rev-parse HEAD` of the checkout, else the --commit given (a copied tree has no .git)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        head = out.stdout.strip() if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        head = None
    if head:
        return {"commit": head, "source": "git rev-parse HEAD", "given": given}
    return {"commit": given, "source": "--commit" if given else "unknown (no git checkout and no --commit)"}

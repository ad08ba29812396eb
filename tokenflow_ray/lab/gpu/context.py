"""What a part's process is given: its mode, its task, where its files go, its deadline, and `save`, which writes
what it has measured so far (a part killed at its limit is recorded with everything it saved)."""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STOP_MARGIN_S = 4.0  # a part that stops itself early keeps this long to write its files before the hard limit
COMMIT_ENV = "TOKENFLOW_BENCH_COMMIT"  # the commit the orchestrator found, for the files parts write


def json_safe(value: Any) -> Any:
    """NaN and infinities (no data) as None, tuples as lists: strict JSON that any reader loads."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def write_json_atomic(path: Path, data: Any, indent: int | None = None) -> None:
    """Written whole or not at all: a reader (or a kill mid-write) never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(json_safe(data), indent=indent, allow_nan=False))
    os.replace(tmp, path)


@dataclass
class PartContext:
    part: str
    mode: str  # full | quick | dry
    task: str | None  # the serving policy; None for single-process parts
    out_dir: Path  # the bench's output folder (files a part writes beside the main JSON)
    result_path: Path  # this task's result, read back by the orchestrator
    limit_s: float
    started: float = field(default_factory=time.monotonic)
    result: dict = field(default_factory=dict)

    @property
    def dry(self) -> bool:
        return self.mode == "dry"

    @property
    def quick(self) -> bool:
        return self.mode == "quick"

    @property
    def deadline(self) -> float:
        """time.monotonic() by which a part that can stop early should have stopped."""
        return self.started + self.limit_s - STOP_MARGIN_S

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self, key: str, value: Any) -> None:
        self.result[key] = value
        write_json_atomic(self.result_path, self.result)

    def unavailable(self, key: str, reason: str) -> None:
        """A piece that cannot run here (a backend not installed, a CUDA-only measurement on the CPU)."""
        self.save(key, {"status": "unavailable", "reason": reason})

    def part_unavailable(self, reason: str) -> None:
        """The whole part cannot run here (what it needs is not merged yet): its status is `unavailable`."""
        self.save("unavailable", reason)

    def device(self):
        import torch

        if self.dry:
            return torch.device("cpu")
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device (use --dry-run on a CPU machine)")
        return torch.device("cuda")

"""One task of one part, in its own process: `python -m tokenflow_ray.lab.gpu.child --part P ...` (the
orchestrator starts it). The part saves its results as it goes; an exception is saved with its traceback and the
process exits 1."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from tokenflow_ray.lab.gpu.budget import MODES, PART_NAMES
from tokenflow_ray.lab.gpu.context import PartContext


def main(argv: list[str] | None = None, runner: Callable[[PartContext], None] | None = None) -> int:
    """`runner`: the part's `run` (default: the part module's; tests pass stand-ins)."""
    p = argparse.ArgumentParser(prog="gpu_bench part")
    p.add_argument("--part", required=True, choices=PART_NAMES)
    p.add_argument("--task")
    p.add_argument("--mode", required=True, choices=MODES)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--result", required=True, type=Path)
    p.add_argument("--limit-s", required=True, type=float)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    ctx = PartContext(args.part, args.mode, args.task, args.out, args.result, args.limit_s)
    ctx.save("task", args.task)
    try:
        run = runner or importlib.import_module(f"tokenflow_ray.lab.gpu.{args.part}").run
        run(ctx)
    except Exception as exc:  # recorded, not raised: the orchestrator reads the error from the result
        ctx.save("error", f"{type(exc).__name__}: {exc}")
        ctx.save("traceback", traceback.format_exc()[-4000:])
        print(traceback.format_exc(), file=sys.stderr, flush=True)
        return 1
    finally:
        ctx.save("wall_s", time.monotonic() - ctx.started)
    return 0


if __name__ == "__main__":
    sys.exit(main())

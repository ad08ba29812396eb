"""The GPU bench: `PYTHONPATH=. python jobs/gpu_bench.py --out DIR` (default $OUT) on one CUDA GPU, at most 8
minutes (`--quick`: 3); `--dry-run` runs every part on the CPU with the embedded model and tiny shapes.

Parts (each in its own process under its own time limit; docs/results/gpu.md says what each measures):
attention, parity, graphs, step_grid, copies, serving. Writes DIR/gpu_bench.json whatever fails, plus
DIR/step_grid.json and DIR/setup_a_eighth_<policy>.json in the formats of ../shared/data/h200/.
The plan of the time budget: tokenflow_ray/lab/gpu/budget.py.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the project, when PYTHONPATH does not name it

from tokenflow_ray.lab.gpu.budget import PART_NAMES  # noqa: E402
from tokenflow_ray.lab.gpu.orchestrator import MAIN_JSON, BenchOptions, run_gpu_bench  # noqa: E402


def _limits(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        part, _, seconds = item.partition("=")
        try:
            out[part] = float(seconds)
        except ValueError:
            raise SystemExit(f"gpu_bench: --limit wants PART=SECONDS, got {item!r}") from None
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=os.environ.get("OUT") or None,
                   help="output folder (default $OUT)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="a subset under 3 minutes (budget.py says what it drops)")
    mode.add_argument("--dry-run", action="store_true", help="every part on the CPU: embedded model, tiny shapes")
    p.add_argument("--parts", default=",".join(PART_NAMES), help=f"comma-separated, of {','.join(PART_NAMES)}")
    p.add_argument("--commit", help="the commit, where the tree has no .git (a copied checkout)")
    p.add_argument("--limit", action="append", default=[], metavar="PART=SECONDS",
                   help="a part's limit per task (serving: per policy), e.g. serving=150 to run it alone longer")
    p.add_argument("--budget-s", type=float, help="the whole bench's budget (default 480, quick 180, dry none; "
                                                  "0: none)")
    args = p.parse_args(argv)
    if args.out is None:
        p.error("--out DIR is needed when $OUT is not set")
    try:
        opts = BenchOptions(out_dir=args.out, mode="quick" if args.quick else "dry" if args.dry_run else "full",
                            parts=tuple(x for x in args.parts.split(",") if x), commit=args.commit,
                            limits=_limits(args.limit), budget_s=args.budget_s)
    except ValueError as exc:
        p.error(str(exc))
    report = run_gpu_bench(opts)
    statuses = {name: part["status"] for name, part in report["parts"].items()}
    print(f"gpu_bench {opts.mode}: {report['wall_s']:.0f} s; {args.out / MAIN_JSON}; files: "
          f"{', '.join(report['files'])}")
    print("parts: " + ", ".join(f"{k} {v}" for k, v in statuses.items()))
    return 0 if all(s in ("ok", "unavailable", "skipped") for s in statuses.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

"""`tokenflow bench ...` subcommands. Each writes one JSON object with --json PATH."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def write_json(path: str | None, obj: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
        print(f"wrote {path}")


def _engine(args: argparse.Namespace) -> int:
    from tokenflow_ray.bench.engine_bench import EngineBenchConfig, run_engine_bench

    cfg = EngineBenchConfig(model=args.model, dtype=args.dtype, batches=args.batch, prompt_len=args.prompt_len,
                            new_tokens=args.new_tokens, repeats=args.repeats, generate_batch=not args.no_generate_batch)
    write_json(args.json, run_engine_bench(cfg))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("engine", help="decode tok/s: engine vs HF generate and generate_batch, roofline, mixed lengths")
    p.add_argument("--model", default="embedded")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--batch", type=_int_list, default=(1, 8, 32, 64), help="comma-separated batch sizes")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-generate-batch", action="store_true", help="skip HF generate_batch (slow)")
    p.add_argument("--json", metavar="PATH")
    p.set_defaults(handler=_engine)

"""`tokenflow tokenizer train|evaluate|export`: Ray Data + Ray Train training from a YAML config, evaluation of a
checkpoint (PSNR/SSIM + a PNG grid), export to the save_pretrained format.

`--set a.b.c=VALUE` reaches every config leaf (model knobs included) on top of the YAML.
`register(subparsers)` is called by the tokenizer group's cli; `main(argv)` runs the same commands standalone
(jobs/*.py use it). Handlers import torch and ray lazily; a bad config is a ValueError (one line, exit 2) raised
before Ray starts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _train(args) -> int:
    from tokenflow_ray.tokenizer.training.config import config_with_overrides, load_config

    cfg = config_with_overrides(load_config(args.config, args.set), workers=args.workers, storage=args.storage,
                                name=args.name)
    from tokenflow_ray.tokenizer.training.trainer import (
        run_training,  # heavy imports only once the config is known to be good
    )

    run = run_training(cfg, show_progress=not args.no_progress)
    report = {"metrics": run.metrics, "checkpoint": run.checkpoint_path, "run_path": run.run_path,
              "attempts": run.attempts}
    print(json.dumps({k: run.metrics.get(k) for k in ("step", "loss", "usage", "images_per_s", "skipped_images")}))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    return 0


def _evaluate(args) -> int:
    from tokenflow_ray.tokenizer.training.evaluate import evaluate_checkpoint

    result = evaluate_checkpoint(args.checkpoint, args.out, num_images=args.num_images, use_ema=not args.no_ema,
                                 fid_features=args.fid_features)
    print(json.dumps(result.to_dict()))
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_dict(), indent=2))
    return 0


def _export(args) -> int:
    from tokenflow_ray.tokenizer.training.export import export_checkpoint

    print(export_checkpoint(args.checkpoint, args.out, use_ema=not args.no_ema))
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("train", help="train the tokenizer with Ray Data + Ray Train from a YAML config")
    p.add_argument("--config", required=True, help="YAML config (see configs/tokenizer/)")
    p.add_argument("--workers", type=int, help="override scaling.num_workers")
    p.add_argument("--storage", help="override run.storage_path (shared storage on a multi-node cluster)")
    p.add_argument("--name", help="override run.name; rerunning the same name + storage resumes the run")
    p.add_argument("--set", action="append", metavar="KEY.PATH=VALUE",
                   help="override any config leaf, e.g. model.quantizer.codebook_size=1024 (repeatable; YAML values)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", help="write the final report here")
    p.set_defaults(handler=_train)

    e = subparsers.add_parser("evaluate", help="PSNR/SSIM/rFID on the held-out split and a PNG sample grid")
    e.add_argument("--checkpoint", required=True, help="checkpoint folder, or a run folder (its latest checkpoint)")
    e.add_argument("--out", required=True, help="folder for metrics.json and samples.png")
    e.add_argument("--num-images", type=int, help="held-out images to score (default: the run's eval.num_images)")
    e.add_argument("--fid-features", help="local transformers vision model directory for rFID (default: the run's "
                                          "eval.fid_features; none: rFID is null)")
    e.add_argument("--no-ema", action="store_true", help="evaluate the raw weights instead of the EMA copy")
    e.add_argument("--json", help="also write the metrics here")
    e.set_defaults(handler=_evaluate)

    x = subparsers.add_parser("export", help="write a checkpoint as a save_pretrained directory")
    x.add_argument("--checkpoint", required=True, help="checkpoint folder, or a run folder (its latest checkpoint)")
    x.add_argument("--out", required=True)
    x.add_argument("--no-ema", action="store_true")
    x.set_defaults(handler=_export)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenflow tokenizer")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"tokenflow: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

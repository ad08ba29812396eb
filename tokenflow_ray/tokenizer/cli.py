"""`tokenflow tokenizer experiment|bench` (and `train` when tokenflow_ray.tokenizer.train_cli exists)."""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

_TRAIN_CLI = "tokenflow_ray.tokenizer.train_cli"


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _write_json(path: str, payload: dict) -> None:
    target = Path(path)
    if target.parent and not target.parent.exists():
        raise ValueError(f"--json directory does not exist: {target.parent}")
    target.write_text(json.dumps(payload, indent=2))


def _sizes(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 2:
        raise argparse.ArgumentTypeError(f"codebook sizes must be >= 2, got {text!r}")
    return values


def _sweep(args: argparse.Namespace) -> int:
    import warnings

    from tokenflow_ray.tokenizer.experiment.sweep import SweepConfig, append_runs, markdown, run_sweep

    seeds = tuple(range(args.first_seed, args.first_seed + (args.seeds or 3)))
    cfg = SweepConfig(dataset=args.dataset, seeds=seeds, codebook_sizes=args.codebook_sizes)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module="sklearn")
        warnings.filterwarnings("ignore", message=".*lbfgs failed to converge.*")
        if Path(args.json).parent and not Path(args.json).parent.exists():
            raise ValueError(f"--json directory does not exist: {Path(args.json).parent}")
        # Each run is merged into --json as soon as it is done (pieces of one sweep, and a piece cut short, add up).
        run_sweep(cfg, on_row=lambda row: append_runs(args.json, [row], cfg))
    result = append_runs(args.json, [], cfg)
    Path(args.plots).mkdir(parents=True, exist_ok=True)
    (Path(args.plots) / "capacity.md").write_text(markdown(result))
    print(markdown(result))
    return 0


def _experiment(args: argparse.Namespace) -> int:
    import dataclasses
    import warnings

    from tokenflow_ray.tokenizer.experiment.report import markdown_table, write_plots
    from tokenflow_ray.tokenizer.experiment.run import QUICK, ExperimentConfig, run_experiment

    if args.codebook_sizes:
        return _sweep(args)
    base = QUICK if args.quick else ExperimentConfig()
    cfg = dataclasses.replace(base, seeds=args.seeds) if args.seeds is not None else base
    cfg = dataclasses.replace(cfg, dataset=args.dataset)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module="sklearn")
        warnings.filterwarnings("ignore", message=".*lbfgs failed to converge.*")
        result = run_experiment(cfg)
    table = markdown_table(result)
    plots = write_plots(result, args.plots)
    (Path(args.plots) / "table.md").write_text(table)
    result["plots"] = plots
    _write_json(args.json, result)
    print(table)
    print(json.dumps(result["verdict"]))
    return 0


def _bench(args: argparse.Namespace) -> int:
    from tokenflow_ray.tokenizer.bench import BenchConfig, run_bench

    cfg = BenchConfig(codebook_size=args.codebook_size, num_tokens=args.tokens, threads=args.threads)
    result = run_bench(cfg)
    if args.train:  # Ray Train images/s with 1 vs 2 workers + step vs data-wait time (training/bench.py)
        from tokenflow_ray.tokenizer.training.bench import TrainBenchConfig, measure_train_throughput

        result.update(measure_train_throughput(TrainBenchConfig(
            steps=args.train_steps, repeats=args.repeats, accum_steps=args.accum_steps, grad_sync=args.grad_sync,
            grad_compress=args.grad_compress)))
    _write_json(args.json, result)
    print(json.dumps({k: v for k, v in result.items() if k != "config"}, indent=2))
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("experiment", help="§6 Tier B experiment on colourised digits or shapes")
    p.add_argument("--json", required=True, help="where to write the result JSON")
    p.add_argument("--plots", required=True, help="directory for PNGs and table.md")
    p.add_argument("--seeds", type=_positive, default=None, help="number of seeds (default 3; 1 with --quick)")
    p.add_argument("--quick", action="store_true", help="reduced run for CI (well under 2 minutes)")
    p.add_argument("--dataset", choices=("digits", "shapes"), default="digits",
                   help="colourised sklearn digits, or colourised synthetic shapes (experiment/data.py)")
    p.add_argument("--codebook-sizes", type=_sizes, metavar="K,K,...",
                   help="capacity sweep instead: arms P, S, TF and bits-matched PxS at each K (perfect squares), "
                        "appended into --json so pieces of one sweep merge; table in PLOTS/capacity.md")
    p.add_argument("--first-seed", type=int, default=0, help="with --codebook-sizes: the first seed of this piece")
    p.set_defaults(handler=_experiment)

    b = subparsers.add_parser("bench", help="chunked shared-index search vs naive cdist+argmin")
    b.add_argument("--json", required=True)
    b.add_argument("--codebook-size", type=_positive, default=32768)
    b.add_argument("--tokens", type=_positive, default=4096)
    b.add_argument("--threads", type=int, choices=(1, 2), default=1,
                   help="torch threads for both methods (default 1: the box is shared, see docs/results/tokenizer.md)")
    b.add_argument("--train", action="store_true",
                   help="also measure Ray Train images/s at the tiny config with 1 and 2 workers (train_images_s)")
    b.add_argument("--accum-steps", type=_positive, default=1,
                   help="with --train: micro-batches per optimiser step (one gradient all-reduce per step)")
    b.add_argument("--train-steps", type=_positive, default=300,
                   help="with --train: steps per run (even; the second half is measured)")
    b.add_argument("--repeats", type=_positive, default=3,
                   help="with --train: rounds of 1 and 2 workers taking turns; figures are medians over rounds")
    b.add_argument("--grad-sync", choices=("auto", "ddp", "flat"), default="auto",
                   help="with --train: scaling.grad_sync of the runs")
    b.add_argument("--grad-compress", choices=("none", "bf16"), default="none",
                   help="with --train: scaling.grad_compress of the runs")
    b.set_defaults(handler=_bench)

    try:
        train_cli = importlib.import_module(_TRAIN_CLI)
    except ModuleNotFoundError as exc:
        if exc.name != _TRAIN_CLI:
            raise
    else:
        train_cli.register(subparsers)

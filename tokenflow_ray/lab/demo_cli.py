"""`tokenflow demo`: a burst of paced streaming clients over HTTP under each policy, compared (lab/demo.py)."""

from __future__ import annotations

import argparse

from tokenflow_ray.cli_args import write_json


def _demo(args: argparse.Namespace) -> int:
    from tokenflow_ray.lab.demo import demo_config, print_table, run_demo
    from tokenflow_ray.lab.demo_plots import write_plots
    from tokenflow_ray.lab.sim_cli import EMBEDDED_MAX_CONTEXT, trace_from_args

    trace = trace_from_args(args, max_context=EMBEDDED_MAX_CONTEXT)
    cfg = demo_config(args.policies, args.streams, args.max_tokens, args.rate, quick=args.quick, trace=trace)
    report, runs = run_demo(cfg)  # Ray and Serve are shut down when it returns: nothing of theirs prints after
    paths = write_plots(runs, args.plots) if args.plots else []
    write_json(args.json, report)
    print(f"demo wall time {report['wall_s']:.0f} s")
    print_table(report)  # the table and the plots' paths are the last lines a newcomer sees
    for path in paths:
        print(f"wrote {path}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    from tokenflow_ray.lab.sim_cli import add_trace_arguments

    d = sub.add_parser("demo", help="a burst of paced streaming clients over HTTP under each policy, compared")
    d.add_argument("--policies", default="tokenflow,fcfs", help="comma-separated policy names")
    d.add_argument("--streams", type=int, help="streams in the burst (default 48, 16 with --quick)")
    d.add_argument("--max-tokens", type=int, help="tokens per stream (default 128, 48 with --quick)")
    d.add_argument("--rate", type=float, help="each reader's consumption rate, tokens/s (default 16)")
    d.add_argument("--quick", action="store_true",
                   help="a short run (16 streams x 48 tokens, both policies): a fresh-install check")
    d.add_argument("--plots", default="out/demo", metavar="DIR", help="where the PNG plots go")
    d.add_argument("--json", metavar="PATH")
    d.add_argument("--length-scale", type=float, default=1.0, help="with --trace: the trace's lengths x this")
    add_trace_arguments(d)
    d.set_defaults(handler=_demo)

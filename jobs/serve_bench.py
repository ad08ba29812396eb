"""Ray job entrypoint: the burst benchmark against the Serve app on the job's cluster; prints the demo's JSON.

    ray start --head                       # or `ray up cluster.yaml`
    serve deploy tokenflow_ray/serve/serve.yaml   # optional: the job deploys the app itself when none runs
    ray job submit --working-dir . -- python jobs/serve_bench.py [--app tokenflow] [--config serve.yaml] \
        [--streams 16] [--max-tokens 48] [--rate 16] [--burst-s 0.5] [--json PATH]
    ... python jobs/serve_bench.py --trace T.csv --window 0:2 --length-scale 0.25 --speed 2   a production trace

The last line of the job's output is one JSON object: `policies: {<policy>: {ttft_mean_s, ttft_p99_s, qoe_mean,
stall_per_stream_mean_s, stall_per_stream_p99_s, raw_tput, effective_tput, ...}}` (docs/design.md §10, `tokenflow demo`), plus the app, its URL and whether the job deployed it.
"""

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the uploaded working dir, if not pip-installed


def main(argv: list[str]) -> int:
    from tokenflow_ray.lab.cluster_bench import DEFAULT_CONFIG, BurstJobConfig, run_burst_job
    from tokenflow_ray.lab.sim_cli import EMBEDDED_MAX_CONTEXT, add_trace_arguments, trace_from_args

    p = argparse.ArgumentParser(prog="serve_bench.py", description=__doc__.splitlines()[0])
    p.add_argument("--app", default="tokenflow")
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="Serve config YAML, deployed if the app is absent")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--rate", type=float, default=16.0)
    p.add_argument("--burst-s", type=float, default=0.5)
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--json", metavar="PATH", help="also write the JSON here")
    p.add_argument("--length-scale", type=float, default=1.0, help="with --trace: the trace's lengths x this")
    add_trace_arguments(p)
    a = p.parse_args(argv)
    try:
        trace = trace_from_args(a, max_context=EMBEDDED_MAX_CONTEXT)
        timeout_s = a.timeout_s + (4 * trace.requests[-1].arrival_s if trace is not None else 0.0)
        cfg = BurstJobConfig(app=a.app, config=a.config, streams=a.streams, max_tokens=a.max_tokens, rate=a.rate,
                             burst_s=a.burst_s, timeout_s=timeout_s, trace=trace)
    except ValueError as exc:
        print(f"serve_bench.py: {exc}", file=sys.stderr)
        return 2
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    # Inside a job: the job's cluster (RAY_ADDRESS). The job's output is the report, so the replicas' logs stay in the
    # cluster's log files (`ray logs`, `serve` logs) instead of streaming here, where the log thread's lines landed
    # inside the report's line.
    ray.init(log_to_driver=False)
    report = run_burst_job(cfg)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    sys.stdout.write(json.dumps(report, sort_keys=True) + "\n")  # one write: no other thread's text splits the line
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

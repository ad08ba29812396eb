"""`tokenflow simulate ...`: the discrete-event simulator (the engine's scheduler on a GPU cost model).

    tokenflow simulate --gpu h200 --model llama3-8b --setup a --policy tokenflow,fcfs --replicas 1 --json P
    tokenflow simulate --table --json P         setups a-d on the 4090 and H200 profiles (the reproduction table)
    tokenflow simulate --sweep rate|mu|delta_t  the rate sweep 20/25/30 tok/s, μ in {1, 20}, Δt in {0.5, 1, 1.5}
    tokenflow simulate --ablation               Table 2 (4090, setup b)
    tokenflow simulate validate --json P        the real CPU engine against the calibrated simulator
    tokenflow simulate validate --trace T.csv --window 0:2 --length-scale 0.25 --speed 4 --json P
                                                a trace on the CPU engine against the sim calibrated on the next window
    tokenflow simulate validate --real R1.json R2.json [--grid G.json] --json P
                                                real GPU runs replayed on the profile fitted on them
    tokenflow simulate --gpu h200-measured --setup a --length-scale 0.125    this engine as measured on an H200
    tokenflow simulate --setup b --tokenflow as_before,ranking=tiers   the policy with some of its fields set
    tokenflow simulate cpu-sweep [--calibration docs/results/runs/sim_validate_cpu.json] --json P
                                                the policy sweep's regimes on the CPU engine's calibrated law
    tokenflow simulate scale --streams 10000 --replicas 64
    tokenflow simulate --replicas 4 --router pinned --migration   each policy with and without live migration
"""

from __future__ import annotations

import argparse
import time

from tokenflow_ray.engine.config import PREFIX_CACHE_MODES


def _progress_factory(enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    def make(label: str):
        bar: list = []

        def update(done: int, total: int) -> None:
            if not bar:
                bar.append(tqdm(total=total, desc=label, unit="stream", leave=False))
            bar[0].n = done
            bar[0].refresh()
            if done >= total:
                bar[0].close()

        return update

    return make


def _print_policies(policies: dict) -> None:
    from tokenflow_ray.metrics.table import policy_table

    print(policy_table(policies))


def _simulate(args: argparse.Namespace) -> int:
    from tokenflow_ray.cli_args import write_json
    from tokenflow_ray.engine.policies import POLICY_NAMES
    from tokenflow_ray.sim import experiments

    args.policy = args.policy or ("fcfs,tokenflow" if args.action == "validate" and args.trace
                                  else "fcfs,andes,tokenflow")
    migration = _migration_settings(args)  # refused up front where it does not apply
    if args.replica_gpus and args.action != "routing":
        raise ValueError("--replica-gpus: only with `tokenflow simulate routing`")
    if (args.real or args.grid) and args.action != "validate":
        raise ValueError("--real, --grid: only with `tokenflow simulate validate`")
    single_run = args.action == "run" and not (args.table or args.table_from or args.sweep or args.ablation)
    if args.length_scale != 1.0 and not single_run and not (args.action == "validate" and args.trace):
        raise ValueError("--length-scale: only with a single setup run or validate --trace")
    if args.tokenflow and (args.action not in ("run", "cpu-sweep") or args.table or args.table_from or args.sweep
                           or args.ablation):
        raise ValueError("--tokenflow: only with a single setup run or cpu-sweep")
    # None without --trace (its options refused then); validate replays it on the embedded model
    trace = trace_from_args(args, max_context=EMBEDDED_MAX_CONTEXT if args.action == "validate" else None)
    if args.action == "validate":
        return _validate(args, trace)
    if args.action == "cpu-sweep":
        return _cpu_sweep(args)
    if args.action == "scale":
        return _scale(args)
    if args.action == "routing":
        return _routing(args)
    policies = tuple(p.strip() for p in args.policy.split(",") if p.strip())
    if unknown := set(policies) - set(POLICY_NAMES):
        raise ValueError(f"--policy: unknown {sorted(unknown)}; choose from {', '.join(POLICY_NAMES)}")
    progress = _progress_factory(not args.no_progress)
    # Table 2 is the 4090's setup (b); everything else defaults to the H200 and setup (a).
    args.gpu_given = args.gpu
    args.gpu = args.gpu or ("4090" if args.ablation else "h200")
    args.setup_given = args.setup is not None
    args.setup = args.setup or ("b" if args.ablation else "a")
    if args.prefix_cache and not single_run:
        raise ValueError("--prefix-cache: only with --trace or a single setup run")
    if args.trace:
        if args.table or args.table_from or args.sweep or args.ablation or args.setup_given or migration:
            raise ValueError("--trace: replaces --setup; not with --table, --sweep, --ablation or --migration")
        out = experiments.run_trace(args.gpu, args.model, trace, policies, replicas=args.replicas,
                                    router=args.router, seed=args.seed, tokenflow=tokenflow_config(args.tokenflow),
                                    checks=not args.no_checks, progress=progress, prefix_cache=args.prefix_cache)
        _print_trace_run(out)
        write_json(args.json, out)
        return 0
    if args.table_from:
        import json
        from pathlib import Path

        runs = {}
        for path in args.table_from.split(","):
            run = json.loads(Path(path).read_text())
            for key, r in (run["runs"].items() if "runs" in run else [(f"{run['setup']['gpu']}/{run['setup']['name']}", run)]):
                runs[key] = r
        print(experiments.reproduction_markdown(runs))
        return 0
    if args.table:
        gpus = (args.gpu_given,) if args.gpu_given else ("4090", "h200")
        out = experiments.reproduction(gpus=gpus, model=args.model, seed=args.seed, progress=progress)
        print(out["table_markdown"])
    elif args.sweep == "rate":
        out = experiments.rate_sweep(args.gpu, args.model, args.setup, seed=args.seed, replicas=args.replicas)
        for rate, row in out["rates"].items():
            print(f"rate {rate}: tokenflow/fcfs {row['ours'].get('vs_fcfs')} (paper effective "
                  f"{row['paper_effective_vs_fcfs']})")
    elif args.sweep in ("mu", "delta_t"):
        values = (1.0, 2.0, 20.0) if args.sweep == "mu" else (0.5, 1.0, 1.5)
        out = experiments.knob_sweep(args.gpu, args.model, args.setup, args.sweep, values, seed=args.seed)
        for v, row in out["values"].items():
            print(f"{args.sweep}={v}: tokenflow/fcfs {row['vs_fcfs']}")
    elif args.ablation:
        out = experiments.ablation(args.gpu, args.model, args.setup, seed=args.seed)
        for v, row in out["variants"].items():
            print(f"{v:>17}: completion {row['completion_s']:8.1f} s ({out['completion_vs_tokenflow'][v]:.2f}x; "
                  f"paper {out['paper_completion_vs_tokenflow'][v]:.2f}x)")
    else:
        out = experiments.run_setup(args.gpu, args.model, args.setup, policies, replicas=args.replicas,
                                    router=args.router, seed=args.seed, rate=args.rate, num_requests=args.requests,
                                    checks=not args.no_checks, progress=progress, migration=migration,
                                    length_scale=args.length_scale, tokenflow=tokenflow_config(args.tokenflow),
                                    prefix_cache=args.prefix_cache, what_if=tuple(w.strip() for w in (args.what_if or "").split(",") if w.strip()))
        out["setup"]["tokenflow"] = args.tokenflow
        print(out["setup"]["describe"], "on", out["setup"]["deployment"], f"x{args.replicas}")
        _print_policies(out["policies"])
        if migration is not None:
            print("with migration:")
            _print_policies(out["migration"]["policies"])
            for name, s in out["migration"]["policies"].items():
                m = s["migration"]
                print(f"{name:>10}: {m['migrations']} moves ({m['moved_streams']} streams, "
                      f"{m['kv_bytes'] / 2**30:.2f} GiB, {m['transfer_s_max'] * 1e3:.1f} ms at most); with/without "
                      + ", ".join(f"{k} {v:.2f}x" for k, v in out["migration"]["vs_no_migration"][name].items()
                                  if v is not None))
        print("ours:", out["ours"])
        print("paper:", out["paper"])
        if args.plots:
            from tokenflow_ray.sim.plots import plot_policies

            plot_policies(out, args.plots)
    write_json(args.json, out)
    return 0


_TRACE_ONLY = ("trace_format", "window", "speed", "rates", "max_context")
EMBEDDED_MAX_CONTEXT = 2048  # the embedded model's context (models/embedded.py): bounds a trace replayed on it


def trace_from_args(args: argparse.Namespace, max_context: int | None = None):
    """The Trace that --trace and its options name (workloads/traces.py; --length-scale scales its lengths), or
    None without --trace, where any of its options is refused."""
    from tokenflow_ray.workloads.traces import TraceOptions, load_trace, parse_rates, parse_window

    if args.trace is None:
        if given := [k for k in _TRACE_ONLY if getattr(args, k) is not None]:
            raise ValueError("--" + given[0].replace("_", "-") + ": only with --trace")
        return None

    options = TraceOptions(window=parse_window(args.window) if args.window else None, speed=args.speed or 1.0,
                           rates=parse_rates(args.rates) if args.rates else TraceOptions().rates,
                           length_scale=args.length_scale, max_context=args.max_context or max_context,
                           seed=getattr(args, "seed", 0), format=args.trace_format)
    return load_trace(args.trace, options)


def _print_trace_run(out: dict) -> None:
    from tokenflow_ray.metrics.guards import describe

    print(out["setup"]["describe"], "on", out["setup"]["deployment"], f"x{out['setup']['replicas']}")
    _print_policies(out["policies"])
    for name, s in out["policies"].items():
        pc = s["prefix_cache"]
        if pc["mode"] != "off":
            total = max(pc["prompt_tokens"], 1)
            print(f"prefix cache {name} ({pc['mode']}): prompt tokens hit {pc['hit_tokens_device'] / total:.1%} on the "
                  f"device, {pc['hit_tokens_host'] / total:.1%} on the host, of {pc['prompt_tokens']:,}")
    for name, report in out.get("guards", {}).items():
        print(f"guards {name}: {'ok' if report['ok'] else 'FAILED'} {describe(report)}")


def add_trace_arguments(p: argparse.ArgumentParser) -> None:
    """--trace and its options, the same on every command that replays a trace."""
    from tokenflow_ray.workloads.traces import TRACE_FORMATS

    g = p.add_argument_group("trace replay (../shared/data/traces/README.md)")
    g.add_argument("--trace", default=None, metavar="PATH",
                   help="replay a production trace: Azure LLM inference CSV, BurstGPT CSV or Mooncake JSONL")
    g.add_argument("--trace-format", default=None, choices=TRACE_FORMATS, help="default: told by the file's content")
    g.add_argument("--window", default=None, metavar="START_MIN:MINUTES",
                   help="the requests arriving in this window, counted from the trace's first (e.g. 0:10)")
    g.add_argument("--speed", type=float, default=None, metavar="X", help="arrivals X times faster (default 1)")
    g.add_argument("--rates", default=None, metavar="RATE:FRACTION,...",
                   help="each stream's reader rate, drawn in these proportions, seeded (default 15:0.4,20:0.6)")
    g.add_argument("--max-context", type=int, default=None, metavar="TOKENS",
                   help="prompt + output at most this (the prompt is cut first)")


def tokenflow_config(spec: str | None):
    """TokenFlowConfig from `--tokenflow`: comma-separated KEY=VALUE fields over the defaults, or over the policy
    as it ran on the first GPU runs when the list starts with `as_before` (tokenflow.AS_BEFORE)."""
    from dataclasses import fields, replace

    from tokenflow_ray.engine.policies import TokenFlowConfig
    from tokenflow_ray.engine.policies.tokenflow_config import AS_BEFORE

    if not spec:
        return None
    items = [i.strip() for i in spec.split(",") if i.strip()]
    cfg = TokenFlowConfig()
    if items and items[0] == "as_before":
        cfg, items = replace(cfg, **AS_BEFORE), items[1:]
    types = {f.name: f.type for f in fields(TokenFlowConfig)}
    values = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or key not in types:
            raise ValueError(f"--tokenflow: expected as_before or KEY=VALUE with KEY a TokenFlowConfig field, got "
                             f"{item!r}")
        current = getattr(cfg, key)
        if raw == "None":
            values[key] = None
        elif isinstance(current, bool):
            values[key] = raw.lower() in ("1", "true", "yes")
        elif isinstance(current, str):
            values[key] = raw
        else:
            values[key] = float(raw)
    return replace(cfg, **values)


def _migration_settings(args: argparse.Namespace):
    if not args.migration:
        return None
    if args.replicas < 2:
        raise ValueError("--migration: needs --replicas >= 2")
    if args.table or args.table_from or args.sweep or args.ablation or args.action != "run":
        raise ValueError("--migration: only with a single setup run (not --table, --sweep, --ablation, validate, scale)")
    from tokenflow_ray.cluster.migration_policy import MigrationSettings

    return MigrationSettings(interval_s=args.migration_interval, move_waiting=args.migration_waiting)


def _validate(args: argparse.Namespace, trace) -> int:
    from tokenflow_ray.cli_args import write_json

    if trace is not None:
        from tokenflow_ray.lab.sim_validate_trace import print_trace_validation, validate_trace

        policies = tuple(p.strip() for p in args.policy.split(",") if p.strip())
        out = validate_trace(trace, policies, repeats=args.repeats)
        print_trace_validation(out)
        write_json(args.json, out)
        return 0
    if args.real:
        import json
        from pathlib import Path

        from tokenflow_ray.sim.validate_real import print_validate_real, validate_real

        grid = json.loads(Path(args.grid).read_text()) if args.grid else None
        out = validate_real(args.real, grid=grid, checks=not args.no_checks)
        print_validate_real(out)
        write_json(args.json, out)
        return 0
    from tokenflow_ray.lab.sim_validate import ValidateConfig, print_validation, run_validation

    cfg = ValidateConfig(num_streams=args.streams or 40, seed=args.seed)
    out = run_validation(cfg, progress=print)
    print_validation(out)
    write_json(args.json, out)
    return 0


def _cpu_sweep(args: argparse.Namespace) -> int:
    from tokenflow_ray.cli_args import write_json
    from tokenflow_ray.lab.sim_cpu_sweep import DEFAULT_CALIBRATION, run_cpu_sweep

    cfg = tokenflow_config(args.tokenflow)
    if cfg is not None and "delta_t=" not in args.tokenflow:
        from dataclasses import replace

        cfg = replace(cfg, delta_t=0.2)  # the policy bench's Δt, as the sweep runs it
    out = run_cpu_sweep(args.calibration or DEFAULT_CALIBRATION, cfg)
    write_json(args.json, out)
    return 0


def _scale(args: argparse.Namespace) -> int:
    from tokenflow_ray.cli_args import write_json
    from tokenflow_ray.sim.scale import run_scale

    streams = args.streams or 10_000
    replicas = args.replicas if args.replicas > 1 else 64
    t = time.perf_counter()
    out = run_scale(streams, replicas, gpu=args.gpu or "h200", model=args.model, policy=args.policy.split(",")[-1],
                    router=args.router, seed=args.seed, checks=not args.no_checks)
    out["wall_s_total"] = time.perf_counter() - t
    print(f"{streams} streams over {replicas} replicas: {out['wall_s']:.1f} s wall, {out['steps']} steps, "
          f"{out['sim_end_s']:.1f} s simulated; effective {out['summary']['effective_tput']:.0f} tok/s, "
          f"P99 TTFT {out['summary']['ttft_p99_s']:.2f} s")
    write_json(args.json, out)
    return 0


def _routing(args: argparse.Namespace) -> int:
    from tokenflow_ray.cli_args import name_list as _name_list
    from tokenflow_ray.cli_args import write_json
    from tokenflow_ray.sim.routing_compare import COMPARED, compare_routers, print_comparison

    gpus = _name_list(args.replica_gpus) if args.replica_gpus else [args.gpu or "h200"] * max(2, args.replicas)
    policy = args.policy.split(",")[-1].strip()
    out = compare_routers(gpus, model=args.model, setups=_name_list(args.setup or "a,d"), routers=COMPARED,
                          policy=policy, seed=args.seed, num_requests=args.requests, checks=not args.no_checks)
    print_comparison(out)
    write_json(args.json, out)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    from tokenflow_ray.sim.hardware import MODEL_NAMES, PROFILE_NAMES
    from tokenflow_ray.sim.setups import DEFAULT_RATE, SETUP_NAMES
    from tokenflow_ray.sim.simulator import ROUTERS

    p = sub.add_parser("simulate", help="discrete-event simulator: the real scheduler on a GPU cost model",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", nargs="?", default="run",
                   choices=("run", "validate", "scale", "routing", "cpu-sweep"),
                   help="run (default): a setup; validate: CPU engine vs calibrated sim (--real: GPU runs); scale: "
                        "a large cluster; routing: slack, pow2 and round_robin on the same requests "
                        "(--replica-gpus, --setup a,d); cpu-sweep: the policy sweep's regimes on the CPU law")
    p.add_argument("--calibration", default=None, metavar="VALIDATE.json",
                   help="cpu-sweep: `simulate validate`'s JSON to take the CPU engine's laws from "
                        "(default docs/results/runs/sim_validate_cpu.json)")
    p.add_argument("--gpu", default=None, choices=PROFILE_NAMES,
                   help="default h200 (4090 with --ablation); h200-measured: this engine as measured on an H200")
    p.add_argument("--length-scale", type=float, default=1.0,
                   help="prompt and output lengths x this (rounded, at least 8 / 16 tokens), KV pools with them: "
                        "0.125 is how the H200 runs at 1/8 were made; with --trace, the trace's lengths")
    p.add_argument("--tokenflow", default=None, metavar="SPEC",
                   help="tokenflow's config for a single setup run: KEY=VALUE,... over the defaults, or as_before[,"
                        "KEY=VALUE...] over the policy as the first GPU runs ran it (TokenFlowConfig.as_run)")
    p.add_argument("--what-if", default=None, metavar="LIST",
                   help="with a measured profile: no_shape_cost (new attention shapes free, as with bucketed "
                        "shapes) and/or fcfs_law (every policy at fcfs's per-step law), comma-separated")
    p.add_argument("--real", nargs="+", default=None, metavar="RUN.json",
                   help="validate: real GPU serving runs (the format of ../shared/data/h200/setup_a_eighth_*.json) "
                        "to calibrate on and replay")
    p.add_argument("--grid", default=None, metavar="GRID.json",
                   help="validate --real: a step grid (step_grid.json) to check the fitted law against")
    p.add_argument("--model", default="llama3-8b", choices=MODEL_NAMES)
    p.add_argument("--setup", default=None,
                   help=f"Table 1 setup (serving-paper.md §5), one of {', '.join(SETUP_NAMES)}; default a (b with "
                        "--ablation); routing: a comma-separated list (default a,d)")
    p.add_argument("--replica-gpus", default=None,
                   help=f"routing: one device per replica, comma-separated ({', '.join(PROFILE_NAMES)}), e.g. "
                        "h200,h200,a6000,a6000; default --replicas (at least 2) of --gpu")
    p.add_argument("--policy", default=None,
                   help="comma-separated policies (default fcfs,andes,tokenflow; validate --trace: fcfs,tokenflow)")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--router", default="slack", choices=ROUTERS, help="with --replicas > 1")
    p.add_argument("--requests", type=int, default=None, help="override the setup's request count")
    p.add_argument("--rate", type=float, default=DEFAULT_RATE, help="reader rate, tok/s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--table", action="store_true",
                   help="setups a-d on the 4090 and H200 profiles (only --gpu's when given)")
    p.add_argument("--table-from", default=None,
                   help="comma-separated JSON files of earlier runs: print their reproduction table")
    p.add_argument("--sweep", choices=("rate", "mu", "delta_t"), default=None)
    p.add_argument("--ablation", action="store_true", help="Table 2 variants (default 4090, setup b)")
    p.add_argument("--streams", type=int, default=None, help="validate: streams per regime (40); scale: streams")
    p.add_argument("--repeats", type=int, default=3, help="validate --trace: real runs per policy (medians)")
    p.add_argument("--migration", action="store_true", help="with --replicas > 1: also with live migration")
    p.add_argument("--migration-interval", type=float, default=1.0, help="the migration tick, virtual s")
    p.add_argument("--migration-waiting", action="store_true",
                   help="streams waiting to start move too (MigrationSettings.move_waiting), not only paused ones")
    p.add_argument("--prefix-cache", default=None, choices=tuple(PREFIX_CACHE_MODES),
                   help="with --trace or one setup: the prefix cache's tiers (default: the engine's, both); hits come "
                        "from the trace's hash_ids (Mooncake) and from paused streams' own blocks")
    p.add_argument("--no-checks", action="store_true", help="skip the per-step conservation checks")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--plots", default=None, help="directory for PNG plots")
    add_trace_arguments(p)
    p.set_defaults(handler=_simulate)

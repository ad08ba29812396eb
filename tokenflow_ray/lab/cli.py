"""`tokenflow bench ...` subcommands. Each writes one JSON object with --json PATH (keys: docs/design.md §10)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tokenflow_ray.cli_args import float_list, int_list, name_list, write_json
from tokenflow_ray.engine.config import DEFAULT_PREFIX_CACHE, PREFIX_CACHE_MODES


def _engine(args: argparse.Namespace) -> int:
    from tokenflow_ray.lab.engine_bench import EngineBenchConfig, run_engine_bench

    cfg = EngineBenchConfig(model=args.model, dtype=args.dtype, batches=args.batch, prompt_len=args.prompt_len,
                            new_tokens=args.new_tokens, repeats=args.repeats, generate_batch=not args.no_generate_batch,
                            peer=args.peer, peer_env=args.vllm_env, overlap=args.overlap,
                            profile_batch=args.profile_batch or None, cpu_gemm=args.cpu_gemm,
                            load_format=args.load_format)
    if args.profile_only:
        from tokenflow_ray.lab.engine_bench import run_step_profile

        try:
            out = run_step_profile(cfg)
        except ValueError as exc:
            print(f"tokenflow: error: {exc}", file=sys.stderr)
            return 2
        write_json(args.json, out)
        return 0
    if cfg.peer:
        from tokenflow_ray.lab.peer.vllm_env import PeerError

        try:
            out = run_engine_bench(cfg)
        except PeerError as exc:  # vLLM setup/run failed: one line, the log path is in it
            print(f"tokenflow: error: {exc}", file=sys.stderr)
            return 1
    else:
        out = run_engine_bench(cfg)
    write_json(args.json, out)
    return 0


def _peer(args: argparse.Namespace) -> int:
    from tokenflow_ray.lab.peer.peer_bench import PeerBenchConfig, print_table, run_peer_bench
    from tokenflow_ray.lab.peer.vllm_env import PeerError

    if args.loads is not None and not args.sweep:
        raise ValueError("--loads needs --sweep")
    chat = args.workload == "conversations"
    if chat and (args.load is not None or args.sweep or args.plots):
        raise ValueError("--workload conversations: not with --load, --sweep or --plots")
    # --load/--sweep size it from the capacity instead
    streams = args.streams if args.streams is not None else (32 if chat else 64)
    systems = args.systems or ("tokenflow,tokenflow-nocache,vllm" if chat else "fcfs,tokenflow,vllm")
    cfg = PeerBenchConfig(workload=args.workload, streams=streams,
                          prompt_len=(48 if chat else 64) if args.prompt_len is None else args.prompt_len,
                          max_tokens=(32 if chat else 256) if args.max_tokens is None else args.max_tokens,
                          rate=args.rate, burst_s=args.burst_s,
                          arrival_rate=args.arrival_rate, kv_blocks=args.kv_blocks, host_blocks=args.host_blocks,
                          threads=args.threads, systems=tuple(s.strip() for s in systems.split(",") if s.strip()),
                          seed=args.seed, timeout_s=args.timeout, vllm_env=args.vllm_env, repeats=args.repeats,
                          turns=args.turns, system_len=args.system_len, max_model_len=2048 if chat else 1024,
                          # vLLM's server log: beside the plots, else out/peer (never beside the JSON: docs/results/runs
                          # holds run files only)
                          log_dir=args.plots or None)
    if args.sweep or args.load is not None:
        return _peer_at_loads(args, cfg)
    try:
        report, runs = run_peer_bench(cfg)
    except PeerError as exc:
        print(f"tokenflow: error: {exc}", file=sys.stderr)
        return 1
    print_table(report)
    if args.plots:
        from tokenflow_ray.lab.peer.plots import write_peer_plots

        report["plots"] = write_peer_plots(runs, report, args.plots)
        print("plots:", ", ".join(report["plots"]))
    write_json(args.json, report)
    failed = [name for name, s in report["systems"].items() if "error" in s]
    return 1 if failed else 0


def _peer_at_loads(args: argparse.Namespace, cfg) -> int:
    """--load X: one bench with streams sized from the measured capacity; --sweep: each of --loads in turn."""
    from tokenflow_ray.lab.peer.peer_bench import print_table
    from tokenflow_ray.lab.peer.peer_sweep import (
        measure_peer_capacity,
        peer_config_for_load,
        run_peer_at_load,
        run_peer_sweep,
    )
    from tokenflow_ray.lab.peer.vllm_env import PeerError
    from tokenflow_ray.lab.sweep import DEFAULT_LOADS

    loads = (args.loads or DEFAULT_LOADS) if args.sweep else (args.load,)
    capacity = measure_peer_capacity(cfg)
    for load in loads:  # every point's config is valid before the first server starts (else exit 2)
        peer_config_for_load(cfg, load, capacity.tok_s)
    try:
        if args.sweep:
            report = run_peer_sweep(cfg, loads, capacity, plots_dir=args.plots)
            if args.plots:
                from tokenflow_ray.lab.sweep_plots import write_sweep_plot

                report["plots"] = [write_sweep_plot(report["sweep"], Path(args.plots) / "sweep.png",
                                                    line_workload=cfg.workload,
                                                    title=f"peer: {cfg.workload} across loads "
                                                          f"(Γ = {capacity.tok_s:.0f} tok/s in-process)")]
                print("plots:", ", ".join(report["plots"]))
            failed = [p["load"] for p in report["sweep"] for s in p["policies"].values() if "error" in s]
        else:
            report, runs = run_peer_at_load(cfg, args.load, capacity)
            print_table(report)
            if args.plots:
                from tokenflow_ray.lab.peer.plots import write_peer_plots

                report["plots"] = write_peer_plots(runs, report, args.plots)
                print("plots:", ", ".join(report["plots"]))
            failed = [name for name, s in report["systems"].items() if "error" in s]
    except PeerError as exc:
        print(f"tokenflow: error: {exc}", file=sys.stderr)
        return 1
    write_json(args.json, report)
    return 1 if failed else 0


def _policies(args: argparse.Namespace) -> int:
    from tokenflow_ray.engine.policies import TokenFlowConfig
    from tokenflow_ray.lab.policy_bench import PolicyBenchConfig, run_policy_bench
    from tokenflow_ray.lab.policy_plots import write_policy_plots

    if args.length_scale is None:
        args.length_scale = 1.0 if args.trace else 1 / 8
    cfg = PolicyBenchConfig(workload=args.workload, num_requests=args.requests, rate=args.rate,
                            kv_fraction=args.kv_fraction, length_scale=1 / 8 if args.trace else args.length_scale,
                            seed=args.seed,
                            repeats=args.repeats, prefix_cache=args.prefix_cache,
                            policies=tuple(p for p in args.policies.split(",") if p),
                            tokenflow=TokenFlowConfig(delta_t=args.delta_t, mu=args.mu, pace=args.pace))
    from tokenflow_ray.lab.sim_cli import EMBEDDED_MAX_CONTEXT, trace_from_args

    trace = trace_from_args(args, max_context=EMBEDDED_MAX_CONTEXT)
    if trace is not None:
        from dataclasses import replace

        from tokenflow_ray.lab.policy_bench import TRACE_POOL_BLOCKS

        if args.sweep or args.workload != "burst" or args.requests != 48:
            raise ValueError("--trace: replaces --workload and --requests; not with --sweep")
        cfg = replace(cfg, pool_blocks=TRACE_POOL_BLOCKS)
    if args.sweep:
        return _policy_sweep(args, cfg)
    if args.loads is not None or args.presets is not None:
        raise ValueError("--loads and --presets need --sweep")
    out, artifacts = run_policy_bench(cfg, ablation=args.ablation, replay=trace)
    if args.plots:
        out["plots"] = write_policy_plots(artifacts, args.plots)
        print("plots:", ", ".join(out["plots"]))
    write_json(args.json, out)
    return 0


def _policy_sweep(args: argparse.Namespace, base) -> int:
    from tokenflow_ray.lab.sweep import DEFAULT_LOADS, PRESETS, SweepConfig, run_sweep

    if args.ablation or args.workload != "burst":
        raise ValueError("--sweep runs the burst across --loads and then the --presets; it takes neither "
                         "--ablation nor --workload")
    cfg = SweepConfig(base=base, loads=args.loads or DEFAULT_LOADS,
                      presets=PRESETS if args.presets is None else args.presets)  # a bad value: exit 2
    out = run_sweep(cfg)
    if args.plots:
        from tokenflow_ray.lab.sweep_plots import write_sweep_plot

        out["plots"] = [write_sweep_plot(out["sweep"], Path(args.plots) / "sweep.png")]
        print("plots:", ", ".join(out["plots"]))
    write_json(args.json, out)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from tokenflow_ray.lab.serve_bench import ServeBenchConfig, run_serve_bench

    result = run_serve_bench(ServeBenchConfig(streams=args.streams, max_tokens=args.max_tokens, runs=args.runs,
                                              threads=args.threads))
    print(f"HTTP {result['http_tok_s']:.0f} tok/s vs in-process {result['inproc_tok_s']:.0f} tok/s "
          f"({result['ratio']:.2f}x) at {result['streams']} streams")
    write_json(args.json, result)
    return 0


def _routing(args: argparse.Namespace) -> int:
    from tokenflow_ray.lab.routing_bench import RoutingBenchConfig, print_table, run_routing_bench

    cfg = RoutingBenchConfig(streams=args.streams, max_tokens=args.max_tokens, rate=args.rate, burst_s=args.burst_s,
                             replicas=args.replicas, rounds=args.rounds, warm_rounds=args.warm_rounds,
                             seed=args.seed, routers=args.routers,
                             cpus_per_replica=args.cpus_per_replica, pin_cpus=args.pin_cpus, timeout_s=args.timeout,
                             long_prompt_share=args.long_prompt_share, long_prompt_tokens=args.long_prompt_tokens,
                             device_blocks=args.device_blocks)
    report, runs = run_routing_bench(cfg)
    print_table(report)
    if args.plots:
        from tokenflow_ray.lab.routing_plots import write_routing_plot

        report["plots"] = [str(write_routing_plot(runs, Path(args.plots) / "routing.png"))]
        print("plots:", ", ".join(report["plots"]))
    write_json(args.json, report)
    return 0 if all(r["complete"] == cfg.streams for r in report["routers"].values()) else 1


def _migration(args: argparse.Namespace) -> int:
    from tokenflow_ray.lab.migration_bench import MigrationBenchConfig, print_table, run_migration_bench

    cfg = MigrationBenchConfig(contexts=args.contexts, moves=args.moves, streams=args.streams,
                               max_tokens=args.max_tokens, rate=args.rate, rounds=args.rounds, seed=args.seed,
                               timeout_s=args.timeout, move_waiting=args.move_waiting)
    report = run_migration_bench(cfg)
    print_table(report)
    write_json(args.json, report)
    return 0 if all(r["complete"] == cfg.streams for arm in report["hot_replica"].values()
                    for r in arm["rounds"]) else 1


def _host(args: argparse.Namespace) -> int:
    from tokenflow_ray.lab.host_bench import config_from_args, run_host_bench

    write_json(args.json, run_host_bench(config_from_args(args)))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    from tokenflow_ray.engine.policies import TokenFlowConfig
    from tokenflow_ray.lab.sim_cli import add_trace_arguments

    p = sub.add_parser("policies", help="one workload through the real engine under fcfs, andes and tokenflow")
    p.add_argument("--workload", default="burst", choices=["burst", "poisson", "gamma", "mixed"])
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--rate", type=float, default=20.0, help="reader rate, tokens/s")
    p.add_argument("--kv-fraction", type=float, default=0.3, help="device KV pool / the burst's full-length KV")
    p.add_argument("--length-scale", type=float, default=None,
                   help="scale on the paper's Table 1 lengths (default 1/8), or with --trace on the trace's (default 1)")
    p.add_argument("--policies", default="fcfs,andes,tokenflow")
    p.add_argument("--delta-t", type=float, default=0.2, help="tokenflow: seconds between working-set decisions")
    p.add_argument("--mu", type=float, default=2.0, help="tokenflow: buffer conservativeness")
    p.add_argument("--pace", action=argparse.BooleanOptionalAction, default=TokenFlowConfig().pace,
                   help="tokenflow: deadline-aware pacing (the policy's default: on; --no-pace for off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="median over this many runs")
    p.add_argument("--ablation", action="store_true", help="also: no offload, no write-through, no overlap")
    p.add_argument("--prefix-cache", default=DEFAULT_PREFIX_CACHE, choices=tuple(PREFIX_CACHE_MODES),
                   help="the prefix cache's tiers (default: both, the engine's default)")
    p.add_argument("--sweep", action="store_true",
                   help="the burst at --loads x measured decode capacity, then the --presets (one PNG: sweep.png)")
    p.add_argument("--loads", type=float_list, help="--sweep: burst loads, x capacity (default 0.5,0.75,1,1.25,1.5)")
    p.add_argument("--presets", type=name_list,
                   help="--sweep: any of poisson,gamma,mixed at load 1 (default all; '' for none)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plots", metavar="DIR")
    add_trace_arguments(p)
    p.set_defaults(handler=_policies)

    p = sub.add_parser("engine", help="decode tok/s: engine vs HF generate and generate_batch, roofline, mixed lengths")
    p.add_argument("--model", default="embedded", help="local HF model directory, hub id, 'embedded', or a built-in "
                                                       "config (llama3-8b, qwen2-7b, qwen2.5-32b: --load-format dummy)")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights from the model's config, no checkpoint read")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--batch", type=int_list, default=(1, 8, 32, 64), help="comma-separated batch sizes")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-generate-batch", action="store_true", help="skip HF generate_batch (slow)")
    p.add_argument("--peer", choices=["vllm"], help="also vLLM's offline decode tok/s (own venv, created if missing)")
    p.add_argument("--vllm-env", metavar="DIR", help="the vLLM venv (default: <cache>/peers/vllm-<version>)")
    p.add_argument("--overlap", action="store_true",
                   help="headline figures with overlapped scheduling (both modes are measured either way)")
    p.add_argument("--profile-batch", type=int, default=32, help="profile a decode step at this batch (0: skip)")
    from tokenflow_ray.engine.config import CPU_GEMMS  # pure Python: --help stays fast

    p.add_argument("--cpu-gemm", default="auto", choices=list(CPU_GEMMS),
                   help="the linear layers' kernel (auto: the panel GEMM on AVX-512 CPUs, else oneDNN)")
    p.add_argument("--profile-only", action="store_true",
                   help="only the step profile at --profile-batch, --repeats times (median): no HF, no peers")
    p.add_argument("--json", metavar="PATH")
    p.set_defaults(handler=_engine)

    p = sub.add_parser("peer", help="one workload against our server (fcfs, tokenflow) and vLLM: same model, KV bytes, "
                                    "client")
    p.add_argument("--workload", default="burst", choices=["burst", "poisson", "mixed", "conversations"],
                   help="conversations: multi-turn chat behind one system prompt, closed loop (prefix caching)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--streams", type=int, help="stream count (default 64; conversations: conversations, 32)")
    size.add_argument("--load", type=float, metavar="X",
                      help="streams = round(X x measured decode capacity / rate), capacity measured at this config")
    size.add_argument("--sweep", action="store_true", help="each of --loads in turn (JSON sweep: [...], sweep.png)")
    p.add_argument("--loads", type=float_list, help="--sweep: loads, x capacity (default 0.5,0.75,1,1.25,1.5)")
    p.add_argument("--prompt-len", type=int, default=None,
                   help="mean prompt tokens (default 64; conversations: each user message, 48)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="output tokens per stream, exact (default 256; conversations: each reply, 32)")
    p.add_argument("--turns", type=int, default=4, help="conversations: turns per conversation")
    p.add_argument("--system-len", type=int, default=1024, help="conversations: the shared system prompt, tokens")
    p.add_argument("--rate", type=float, default=20.0, help="reader rate, tokens/s (mixed: 40%% at 0.75x)")
    p.add_argument("--burst-s", type=float, default=1.0, help="burst/mixed: arrivals spread over this long")
    p.add_argument("--arrival-rate", type=float, default=4.0, help="poisson: requests/s")
    p.add_argument("--kv-blocks", type=int, default=480,
                   help="device KV pool in our 16-token blocks; vLLM gets the same bytes in 128-token blocks")
    p.add_argument("--host-blocks", type=int, default=4096, help="our CPU spill store, blocks")
    p.add_argument("--threads", type=int, default=2, help="our replica's CPUs/torch threads = vLLM's OpenMP threads")
    p.add_argument("--systems", default=None,
                   help="any of fcfs,tokenflow,fcfs-nocache,tokenflow-nocache,vllm, run in that order (default "
                        "fcfs,tokenflow,vllm; conversations: tokenflow,tokenflow-nocache,vllm)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per system for the measured load")
    p.add_argument("--repeats", type=int, default=1, help="median over this many rounds (systems take turns)")
    p.add_argument("--vllm-env", metavar="DIR", help="the vLLM venv (default: <cache>/peers/vllm-<version>)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plots", metavar="DIR", help="PNG plots; vLLM's server log goes here too")
    p.set_defaults(handler=_peer)

    p = sub.add_parser("routing", help="a seeded burst over 2 replicas: the buffer-slack router vs Serve's default")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=192, help="mean output tokens (each stream 0.5x-1.5x)")
    p.add_argument("--rate", type=float, default=30.0, help="mean reader rate, tokens/s (each 0.25x or 1.75x)")
    p.add_argument("--burst-s", type=float, default=2.0, help="arrivals spread over this long")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per router; medians reported")
    p.add_argument("--warm-rounds", type=int, default=1,
                   help="unmeasured bursts per router first (kept apart in the JSON): no router takes the cold start")
    p.add_argument("--routers", type=name_list, default=("slack", "default"))
    p.add_argument("--cpus-per-replica", type=float, default=1.0)
    p.add_argument("--pin-cpus", action="store_true",
                   help="pin each replica to --cpus-per-replica CPUs of its own (replicas as separate devices)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per run")
    p.add_argument("--long-prompt-share", type=float, default=0.0,
                   help="share of streams with a long context prompt (seeded; 0: short prompts only)")
    p.add_argument("--long-prompt-tokens", type=int, default=1024,
                   help="mean long prompt length in tokens (each 0.5x-1.5x)")
    p.add_argument("--device-blocks", type=int_list, default=(),
                   help="a mixed fleet: replica i's device KV pool in blocks, e.g. 384,128 (default: 256 each)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plots", default="out/routing", metavar="DIR", help="where routing.png goes ('' for none)")
    p.set_defaults(handler=_routing)

    p = sub.add_parser("migration", help="a moved stream's downtime vs its recompute, and a hot replica relieved by "
                                         "migration vs not")
    p.add_argument("--contexts", type=int_list, default=(64, 256, 512, 1024), help="stream lengths at the move")
    p.add_argument("--moves", type=int, default=5, help="moves per context length")
    p.add_argument("--streams", type=int, default=48, help="the hot replica's burst")
    p.add_argument("--max-tokens", type=int, default=192, help="mean output tokens (each stream 0.5x-1.5x)")
    p.add_argument("--rate", type=float, default=30.0, help="mean reader rate, tokens/s (each 0.5x or 1.5x)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per arm; medians reported")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per round")
    p.add_argument("--move-waiting", action="store_true", help="the policy also moves streams waiting to start")
    p.add_argument("--json", metavar="PATH")
    p.set_defaults(handler=_migration)

    s = sub.add_parser("serve", help="the same streams through HTTP/SSE (Ray Serve) vs in-process")
    s.add_argument("--streams", type=int, default=32)
    s.add_argument("--max-tokens", type=int, default=256, help="tokens per stream (fixed per-request HTTP cost weighs more on short streams)")
    s.add_argument("--runs", type=int, default=3, help="alternating runs per side; the median is reported")
    s.add_argument("--threads", type=int, default=1, help="torch threads on both sides")
    s.add_argument("--json", metavar="PATH")
    s.set_defaults(handler=_serve)

    h = sub.add_parser("host", help="the engine's host time per step (schedule + update) with a no-op device")
    h.add_argument("--streams", type=int_list, default=(100, 400, 1000), help="live streams, e.g. 100,400")
    h.add_argument("--policies", type=name_list, default=("fcfs", "tokenflow", "andes"))
    h.add_argument("--steps", type=int, default=200, help="measured steps per run")
    h.add_argument("--warmup", type=int, default=50, help="steps run first, not measured")
    h.add_argument("--repeats", type=int, default=3, help="runs per cell; medians reported")
    h.add_argument("--step-ms", type=float, default=20.0, help="virtual time a step takes (a device step)")
    h.add_argument("--seed", type=int, default=0)
    h.add_argument("--prefix-cache", default=DEFAULT_PREFIX_CACHE, choices=tuple(PREFIX_CACHE_MODES),
                   help="the prefix cache's tiers (default: both, the engine's default)")
    h.add_argument("--json", metavar="PATH")
    h.set_defaults(handler=_host)

"""`tokenflow serve`."""

from __future__ import annotations

import argparse


def _serve(args: argparse.Namespace) -> int:
    from tokenflow_ray.serve.config import ServeConfig
    from tokenflow_ray.serve.preflight import preflight

    # model, load_format and policy are engine options: ServeConfig.from_dict puts them in its engine config.
    overrides = {"model": args.model, "load_format": args.load_format, "replicas": args.replicas,
                 "policy": args.policy, "host": args.host, "port": args.port, "api_key": args.api_key,
                 "router": args.router, "http": args.http, "tokenizer_dir": args.tokenizer, "pin_cpus": args.pin_cpus,
                 "enable_prefix_caching": False if args.no_prefix_caching else None}
    if args.config:
        config = ServeConfig.from_yaml(args.config, **overrides)
    else:
        config = ServeConfig.from_dict({}, **overrides)
    preflight(config)  # a bad model path, tokenizer or value: one line, exit 2, before Ray starts

    from tokenflow_ray.serve.lifecycle import run_server

    return run_server(config)


def register(sub: argparse._SubParsersAction) -> None:
    from tokenflow_ray.serve.config import HTTP_PLACEMENTS, ROUTERS

    p = sub.add_parser("serve", help="deploy the OpenAI-compatible app on local Ray (or RAY_ADDRESS)")
    p.add_argument("--model", help="local HF model directory, hub id, or 'embedded' (default)")
    p.add_argument("--load-format", choices=["auto", "dummy"],
                   help="dummy: random weights from the model's config (a built-in config such as llama3-8b needs it)")
    p.add_argument("--replicas", type=int)
    p.add_argument("--policy", help="scheduling policy: tokenflow, andes or fcfs")
    p.add_argument("--router", choices=ROUTERS,
                   help="replica choice for new streams: Serve's default (power of two choices on queue length) or "
                        "slack (buffer-slack: soonest start without starving a replica's readers)")
    p.add_argument("--http", choices=HTTP_PLACEMENTS,
                   help="who answers HTTP: the replicas (direct, one hop; default) or an ingress deployment in front "
                        "(a dead replica's streams then get an error event instead of a closed connection)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="compute every prompt from its first token (default: reuse the KV of a cached prefix, on the "
                        "device and in the host store)")
    p.add_argument("--config", metavar="serve.yaml", help="a Serve config YAML (also valid for `serve run`)")
    p.add_argument("--pin-cpus", type=int, metavar="N",
                   help="pin each replica to N CPUs of its own, by its local rank on the node (default 0: none)")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--tokenizer", metavar="DIR", help="serve this trained image tokenizer (a `tokenflow tokenizer "
                                                      "export` folder) on /v1/images/*")
    p.set_defaults(handler=_serve)

"""The `tokenflow` console script.

Each part of the project registers its own subcommands (a `register(subparsers)` function in its `cli` module), so
this file only wires groups together. Handlers import heavy libraries lazily: `tokenflow --help` stays fast.
Errors a user can fix (bad flags, bad values, missing paths) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# (group, module): group None registers top-level commands; otherwise the module adds subcommands to that group.
_COMMAND_MODULES: tuple[tuple[str | None, str], ...] = (
    (None, "tokenflow_ray.entrypoints.generate"),
    ("bench", "tokenflow_ray.lab.cli"),
    (None, "tokenflow_ray.serve.cli"),
    (None, "tokenflow_ray.lab.demo_cli"),
    ("tokenizer", "tokenflow_ray.tokenizer.cli"),
    (None, "tokenflow_ray.lab.sim_cli"),
)

_GROUP_HELP = {
    "bench": "benchmarks; each writes one JSON object with --json PATH",
    "tokenizer": "the dual-codebook image tokenizer: experiment, training, benchmark",
}


class UserError(ValueError):
    """A problem the user can fix; printed as one line, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenflow", description=__doc__.splitlines()[0])
    top = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    groups: dict[str, argparse._SubParsersAction] = {}
    for group, module_name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:  # a part not built yet: its commands are simply absent
                continue
            raise
        if group is None:
            module.register(top)
            continue
        if group not in groups:
            group_parser = top.add_parser(group, help=_GROUP_HELP.get(group))
            groups[group] = group_parser.add_subparsers(dest=f"{group}_command", required=True, metavar="COMMAND")
        module.register(groups[group])
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result = args.handler(args)
    except (UserError, ValueError, FileNotFoundError) as exc:
        print(f"tokenflow: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tokenflow: interrupted", file=sys.stderr)
        return 130
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())

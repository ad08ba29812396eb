"""Run `tokenflow ... --help` for every command and group, as separate processes (what a user types).

Run in the no-extras venv: a command whose module needs a package that only an extra brings fails here.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from tokenflow_ray.cli import build_parser


def command_paths(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    paths = [prefix]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                paths += command_paths(sub, (*prefix, name))
    return paths


def main() -> int:
    failed = []
    paths = command_paths(build_parser())
    for path in paths:
        proc = subprocess.run(["tokenflow", *path, "--help"], capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            failed.append(path)
            print(f"FAILED: tokenflow {' '.join(path)} --help\n{proc.stderr[-2000:]}", file=sys.stderr)
    print(f"tokenflow --help: {len(paths) - len(failed)} of {len(paths)} commands OK")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

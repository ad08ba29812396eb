"""A stand-in for a bench part's process (tests of the orchestrator): `attention` saves a partial result and then
outlives any limit, `parity` raises, every other part succeeds at once."""

from __future__ import annotations

import sys
import time

from tokenflow_ray.lab.gpu import child
from tokenflow_ray.lab.gpu.context import PartContext


class _Parts:
    @staticmethod
    def attention(ctx: PartContext) -> None:
        ctx.save("first_half", {"max_abs": 1e-6})
        time.sleep(600)

    @staticmethod
    def parity(ctx: PartContext) -> None:
        ctx.save("float32", {"identical": 1, "of": 2})
        raise RuntimeError("boom")

    @staticmethod
    def other(ctx: PartContext) -> None:
        ctx.save("headline", f"{ctx.part} fine")


def main() -> int:
    args = sys.argv[1:]
    part = args[args.index("--part") + 1]
    fn = getattr(_Parts, part, _Parts.other)
    return child.main(args, runner=fn)


if __name__ == "__main__":
    sys.exit(main())

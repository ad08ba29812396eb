"""torch's intra-op thread count for the length of a block, then the caller's count again."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """`torch.set_num_threads(n)` inside the block. The count is process state: a library call that sets it for its
    own work (an experiment at 1 thread) would otherwise leave every later torch op of its caller at that count."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)

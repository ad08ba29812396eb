"""Per-interval training metrics, accumulated on each rank and combined over ranks at report time."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence


class IntervalMeter:
    """Sums loss terms, images, data-wait and step time since the last flush.

    Reported per interval: mean of each loss term (over steps and ranks), codebook usage (mean over ranks),
    images/s (all ranks' images / interval wall time), step_time_s and data_wait_s (mean per step per rank),
    data_wait_frac = wait / (wait + step): how much of a worker's time the input pipeline costs it, and sync_time_s:
    the part of step_time_s spent in the explicit gradient all-reduce, including waiting there for the slowest rank
    (under DDP the generator's all-reduce overlaps its backward and is not in it).
    """

    def __init__(self, terms: Sequence[str]) -> None:
        self.terms = tuple(terms) + ("disc_loss",)
        self.skipped = 0
        self._reset()

    def _reset(self) -> None:
        self.sums = dict.fromkeys(self.terms, 0.0)
        self.steps = self.images = 0
        self.wait_s = self.step_s = self.sync_s = self.usage = 0.0
        self.t_start = time.perf_counter()

    def restart_clock(self) -> None:
        self.t_start = time.perf_counter()

    def add(self, terms: dict[str, float], images: int, wait_s: float, step_s: float, usage: float,
            sync_s: float = 0.0) -> None:
        for k, v in terms.items():
            self.sums[k] += v
        self.steps += 1
        self.images += images
        self.wait_s += wait_s
        self.step_s += step_s
        self.sync_s += sync_s
        self.usage = usage

    def flush(self, all_reduce: Callable[[list[float]], list[float]], world: int) -> dict:
        """Combine over ranks (one collective: every rank must call this at the same step) and start a new interval."""
        elapsed = time.perf_counter() - self.t_start
        local = [self.sums[k] for k in self.terms] + [self.steps, self.images, self.wait_s, self.step_s, self.sync_s,
                                                       self.usage, self.skipped, elapsed]
        g = all_reduce(local)
        n = len(self.terms)
        steps, images, wait_s, step_s, sync_s, usage, skipped, elapsed_sum = g[n:]
        steps = max(steps, 1)
        out = {k: g[i] / steps for i, k in enumerate(self.terms)}
        out.update(usage=usage / world, images=int(images), images_per_s=images / max(elapsed_sum / world, 1e-9),
                   step_time_s=step_s / steps, sync_time_s=sync_s / steps, data_wait_s=wait_s / steps,
                   data_wait_frac=wait_s / max(wait_s + step_s, 1e-9), skipped_images_interval=int(skipped))
        self.skipped = 0
        self._reset()
        return out

"""Training throughput bench: images/s of the tiny config with 1 and with 2 Ray Train workers, in one invocation, plus
where a worker's time goes (compute step, of which gradient sync, vs waiting on the Ray Data pipeline).

Each worker runs one intra-op thread, so N workers use N cores and the ratio measures data parallelism, not torch
threading. The worker counts take turns within each of `repeats` rounds (this 2-core box drifts by +-10% over
minutes, so a ratio is only meaningful between runs next to each other); the headline ratio is the median of the
per-round ratios, and every round is kept in the JSON. Figures come from the second half of each run (the last
report interval: pipeline start-up and warm-up excluded, and long enough that prefetched data cannot hide a
pipeline that falls behind); checkpoint and report time are excluded by the meter. The same step in independent
processes (no Ray, no sync; `ceiling.py`) is measured in the same invocation as the ceiling the ratio can reach on
this box, once per round, so each round gives its own `train_vs_ceiling` = (2-vs-1 ratio) / (ceiling's 2-vs-1 ratio);
the headline is the median over rounds. Each round also runs the 2-worker config over a dataset a third the size
(3 epochs in the run instead of 1): with the indexed pipeline an epoch boundary costs nothing, so
`train_epochs_ratio` (images/s at 3 epochs / at 1) should be ~1. `tokenflow tokenizer bench --train` merges this
dict into the bench JSON.
"""

from __future__ import annotations

import statistics
import tempfile
from dataclasses import asdict, dataclass

FIGURES = ("images_per_s", "step_time_s", "sync_time_s", "data_wait_s", "data_wait_frac")


@dataclass(frozen=True)
class TrainBenchConfig:
    steps: int = 300  # per run; the second half is measured
    batch_size: int = 16  # per worker
    workers: tuple[int, ...] = (1, 2)
    repeats: int = 3  # rounds; each runs every worker count once
    map_workers: int = 1
    map_cpus: float = 0.25
    accum_steps: int = 1  # micro-batches per optimiser step (one gradient all-reduce each)
    grad_sync: str = "auto"  # scaling.grad_sync of the runs
    grad_compress: str = "none"  # scaling.grad_compress of the runs
    pin_cpus: bool = True  # scaling.pin_cpus of the runs (the tiny config's setting)
    ceiling: bool = True  # also time the same step in independent processes, without Ray or sync (ceiling.py)
    epochs_check: bool = True  # also run max(workers) over 3 epochs of a third of the data (epoch-boundary cost)

    def __post_init__(self) -> None:
        if self.steps < 4 or self.steps % 2:
            raise ValueError(f"steps must be an even number >= 4, got {self.steps}")
        if self.batch_size < 1 or self.repeats < 1 or not self.workers or min(self.workers) < 1 \
                or self.accum_steps < 1:
            raise ValueError("batch_size, repeats, accum_steps and worker counts must be >= 1")

    def num_images(self, epochs: int = 1) -> int:
        """Training images so that the run's samples make `epochs` passes over them."""
        return (self.steps * self.batch_size * self.accum_steps * max(self.workers) + 4 * self.batch_size) // epochs


def train_config(cfg: TrainBenchConfig, workers: int, storage: str, name: str, epochs: int = 1):
    from tokenflow_ray.tokenizer.training.config import TrainConfig

    return TrainConfig().replace(
        data={"source": "digits", "num_images": cfg.num_images(epochs), "batch_size": cfg.batch_size,
              "map_workers": cfg.map_workers, "map_cpus": cfg.map_cpus},
        optim={"lr": 1e-3, "ema_decay": 0.99, "accum_steps": cfg.accum_steps},
        schedule={"steps": cfg.steps, "log_every": cfg.steps // 2, "checkpoint_every": cfg.steps},
        scaling={"num_workers": workers, "cpus_per_worker": 0.5, "torch_threads": 1, "max_failures": 0,
                 "grad_sync": cfg.grad_sync, "grad_compress": cfg.grad_compress, "pin_cpus": cfg.pin_cpus},
        run={"name": name, "storage_path": storage})


def summarize(rounds: list[dict[int, dict]], workers: tuple[int, ...]) -> dict:
    """Medians over rounds of each figure per worker count, and of the per-round 2-vs-1 ratio."""
    out = {f"train_{k}": {n: statistics.median(r[n][k] for r in rounds) for n in workers} for k in FIGURES}
    out["train_images_s"] = out.pop("train_images_per_s")
    out["train_rounds"] = [{n: r[n] for n in workers} for r in rounds]
    if 1 in workers and 2 in workers:
        ratios = [r[2]["images_per_s"] / r[1]["images_per_s"] for r in rounds]
        out["train_speedup_2v1"] = statistics.median(ratios)
        out["train_speedup_2v1_rounds"] = ratios
        if all("ceiling" in r for r in rounds):
            vs = [ratio / (r["ceiling"][2] / r["ceiling"][1]) for ratio, r in zip(ratios, rounds)]
            out["train_vs_ceiling"] = statistics.median(vs)
            out["train_vs_ceiling_rounds"] = vs
            out["train_ceiling_rounds"] = [r["ceiling"] for r in rounds]
    if all("epochs3" in r for r in rounds):
        top = max(workers)
        e = [r["epochs3"]["images_per_s"] / r[top]["images_per_s"] for r in rounds]
        out["train_epochs_ratio"] = statistics.median(e)
        out["train_epochs_ratio_rounds"] = e
    return out


def measure_train_throughput(cfg: TrainBenchConfig | None = None, storage_dir: str | None = None,
                             log=print) -> dict:
    from tokenflow_ray.tokenizer.training.trainer import ensure_ray, run_training

    cfg = cfg or TrainBenchConfig()
    # A local instance started here goes without the dashboard's processes: on 2 cores every process beside the 2
    # workers costs them (docs/results/tokenizer.md).
    ensure_ray(include_dashboard=False)
    storage = storage_dir or tempfile.mkdtemp(prefix="tokenflow-train-bench-")
    from tokenflow_ray.tokenizer.training.ceiling import measure_ceiling

    rounds: list[dict] = []
    for r in range(cfg.repeats):
        per: dict = {}
        runs = [(n, 1) for n in cfg.workers] + ([(max(cfg.workers), 3)] if cfg.epochs_check else [])
        runs = runs if r % 2 == 0 else runs[::-1]  # alternate the order: the box drifts within a round
        for n, epochs in runs:
            m = run_training(train_config(cfg, n, storage, f"bench-{n}w-{epochs}e-{r}", epochs),
                             show_progress=False).metrics
            per[n if epochs == 1 else "epochs3"] = {k: m[k] for k in FIGURES}
            log(f"round {r + 1}/{cfg.repeats}, {n} worker(s), {epochs} epoch(s): {m['images_per_s']:.0f} images/s, "
                f"step {1e3 * m['step_time_s']:.1f} ms (sync {1e3 * m['sync_time_s']:.1f}), data wait "
                f"{1e3 * m['data_wait_s']:.2f} ms")
        if cfg.ceiling:
            per["ceiling"] = measure_ceiling(cfg.workers, image_size=16, batch_size=cfg.batch_size)
            log(f"round {r + 1}/{cfg.repeats}, ceiling: {per['ceiling']}")
        rounds.append(per)
    out = summarize(rounds, cfg.workers)
    out["train_bench_config"] = asdict(cfg)
    if cfg.ceiling:
        ceiling = {n: statistics.median(r["ceiling"][n] for r in rounds) for n in cfg.workers}
        out["train_ceiling_images_s"] = ceiling
        if 1 in ceiling and 2 in ceiling:
            out["train_ceiling_2v1"] = statistics.median(r["ceiling"][2] / r["ceiling"][1] for r in rounds)
    return out


if __name__ == "__main__":
    import json
    import os

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    print(json.dumps(measure_train_throughput(), indent=2))

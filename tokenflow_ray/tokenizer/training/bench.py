"""Training throughput bench: images/s of the tiny config with 1 and with 2 Ray Train workers, in one invocation, plus
where a worker's time goes (compute step vs waiting on the Ray Data pipeline).

Each worker runs one intra-op thread, so N workers use N cores and the ratio measures data parallelism, not torch
threading. The same step in independent processes (no Ray, no sync; `ceiling.py`) is measured in the same run as
the ceiling the ratio can reach on this box. The figures come from the second half of each run (the last report interval), after pipeline start-up
and warm-up; checkpoint and report time are excluded by the meter. `tokenflow tokenizer bench --train` merges this
dict into the bench JSON.
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class TrainBenchConfig:
    steps: int = 40
    batch_size: int = 16  # per worker
    num_images: int = 2048
    workers: tuple[int, ...] = (1, 2)
    map_workers: int = 1
    map_cpus: float = 0.25
    accum_steps: int = 1  # micro-batches per optimiser step (one gradient all-reduce each)
    ceiling: bool = True  # also time the same step in independent processes, without Ray or sync (ceiling.py)

    def __post_init__(self) -> None:
        if self.steps < 4 or self.steps % 2:
            raise ValueError(f"steps must be an even number >= 4, got {self.steps}")
        if self.batch_size < 1 or self.num_images < 1 or not self.workers or min(self.workers) < 1 \
                or self.accum_steps < 1:
            raise ValueError("batch_size, num_images, accum_steps and worker counts must be >= 1")


def measure_train_throughput(cfg: TrainBenchConfig | None = None, storage_dir: str | None = None) -> dict:
    from .config import TrainConfig
    from .trainer import run_training

    cfg = cfg or TrainBenchConfig()
    storage = storage_dir or tempfile.mkdtemp(prefix="tokenflow-train-bench-")
    per: dict[int, dict] = {}
    for n in cfg.workers:
        train_cfg = TrainConfig().replace(
            # One epoch covers the run (x accum_steps): an epoch boundary restarts the pipeline mid-measurement.
            data={"source": "digits", "num_images": cfg.num_images * cfg.accum_steps, "image_size": 16,
                  "batch_size": cfg.batch_size,
                  "map_workers": cfg.map_workers, "map_cpus": cfg.map_cpus},
            optim={"lr": 1e-3, "ema_decay": 0.99, "accum_steps": cfg.accum_steps},
            schedule={"steps": cfg.steps, "log_every": cfg.steps // 2, "checkpoint_every": cfg.steps},
            scaling={"num_workers": n, "cpus_per_worker": 0.5, "torch_threads": 1, "max_failures": 0},
            run={"name": f"bench-{n}w", "storage_path": storage})
        m = run_training(train_cfg, show_progress=False).metrics
        per[n] = {k: m[k] for k in ("images_per_s", "step_time_s", "data_wait_s", "data_wait_frac")}
    out = {
        "train_images_s": {n: v["images_per_s"] for n, v in per.items()},
        "train_step_time_s": {n: v["step_time_s"] for n, v in per.items()},
        "train_data_wait_s": {n: v["data_wait_s"] for n, v in per.items()},
        "train_data_wait_frac": {n: v["data_wait_frac"] for n, v in per.items()},
        "train_bench_config": asdict(cfg),
    }
    if 1 in per and 2 in per:
        out["train_speedup_2v1"] = per[2]["images_per_s"] / per[1]["images_per_s"]
    if cfg.ceiling:
        from .ceiling import measure_ceiling

        ceiling = measure_ceiling(cfg.workers, image_size=16, batch_size=cfg.batch_size)
        out["train_ceiling_images_s"] = ceiling
        if 1 in ceiling and 2 in ceiling:
            out["train_ceiling_2v1"] = ceiling[2] / ceiling[1]
    return out


if __name__ == "__main__":
    import json
    import os

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    print(json.dumps(measure_train_throughput(), indent=2))

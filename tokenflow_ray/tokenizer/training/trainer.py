"""Driver side: build the dataset and the TorchTrainer from a TrainConfig, run it with a progress bar, return a
named result.

The run is identified by RunConfig(name, storage_path): rerunning with the same pair resumes from its latest
checkpoint (Ray Train V2). FailureConfig(max_failures) restarts a worker group that lost a worker; the loop then
resumes from the latest checkpoint on its own. The progress bar is fed by a small actor that rank 0 pushes metrics to
(Train V2 callbacks run in the controller actor, not in the driver, so they cannot draw a bar here).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenflow_ray.tokenizer.training.config import TrainConfig


@dataclass(frozen=True)
class ProgressSnapshot:
    step: int
    total_steps: int
    checkpointed_step: int  # step of the latest checkpoint the controller has registered (0: none yet)
    metrics: dict  # the latest interval's metrics ({} before the first report)
    workers: list  # [{rank, node_id, pid}] of the current worker group
    attempts: int  # worker groups started so far (1 + restarts)


@dataclass(frozen=True)
class TrainRun:
    metrics: dict  # last reported metrics (loss terms, usage, images_per_s, step/wait times, skipped_images, ...)
    checkpoint_path: str | None  # latest checkpoint directory
    run_path: str  # the run's folder under storage
    loss_curve: list = field(default_factory=list)  # [step, loss] per interval, across resumes
    attempts: int = 1


def _progress_actor_cls():
    import ray

    @ray.remote(num_cpus=0)
    class ProgressActor:
        def __init__(self) -> None:
            self.metrics, self.workers, self.attempts, self.checkpointed = {}, [], 0, 0

        def register(self, workers: list, resumed_from: int) -> None:
            self.workers, self.attempts = workers, self.attempts + 1

        def update(self, metrics: dict) -> None:
            self.metrics = metrics

        def checkpointed_at(self, step: int) -> None:
            self.checkpointed = max(self.checkpointed, step)

        def snapshot(self) -> tuple[dict, list, int, int]:
            return self.metrics, self.workers, self.attempts, self.checkpointed

    return ProgressActor


def _checkpoint_callback(progress):
    from ray.train import UserCallback

    class CheckpointNotifier(UserCallback):
        """Runs in the Train controller after it registered a report: tells the progress actor which step is now
        restorable (a worker's report returning does not yet mean the controller has registered its checkpoint)."""

        def __init__(self, actor) -> None:
            self.actor = actor

        def after_report(self, run_context, metrics, checkpoint) -> None:
            if checkpoint is not None and metrics:
                self.actor.checkpointed_at.remote(int(metrics[0].get("step", 0)))

    return CheckpointNotifier(progress)


def ensure_ray(include_dashboard: bool | None = None) -> None:
    """Connect to RAY_ADDRESS, or start a local instance (`include_dashboard`: Ray's default when None)."""
    import ray

    if not ray.is_initialized():
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        if os.environ.get("RAY_ADDRESS"):
            ray.init(address=os.environ["RAY_ADDRESS"])
        else:
            # A local instance gets at least 4 logical CPUs: Ray Data's file-listing task asks for a whole CPU, which
            # never fits beside 2 Train workers and the decode actor on a 2-core box (fit() would hang).
            ray.init(num_cpus=max(4, os.cpu_count() or 1), include_dashboard=include_dashboard)


def build_trainer(cfg: TrainConfig, dataset, progress=None, data_info: dict | None = None):
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from tokenflow_ray.tokenizer.training.loop import train_loop

    s = cfg.scaling
    return TorchTrainer(
        train_loop,
        train_loop_config={"train": cfg.to_dict(), "progress": progress,
                           "data": data_info or {"indexed": False, "offset": 0, "num_rows": None}},
        torch_config=TorchConfig(backend="nccl" if s.use_gpu else "gloo"),
        scaling_config=ScalingConfig(num_workers=s.num_workers, use_gpu=s.use_gpu,
                                     resources_per_worker={"CPU": s.cpus_per_worker},
                                     placement_strategy=s.placement_strategy),
        run_config=RunConfig(name=cfg.run.name, storage_path=cfg.run.storage_dir,
                             failure_config=FailureConfig(max_failures=s.max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=cfg.schedule.keep_checkpoints),
                             callbacks=[_checkpoint_callback(progress)] if progress is not None else None),
        datasets={"train": dataset},
    )


def run_training(cfg: TrainConfig, show_progress: bool = True,
                 watcher: Callable[[ProgressSnapshot], None] | None = None, poll_s: float = 0.5) -> TrainRun:
    """Train to cfg.schedule.steps (resuming the run of the same name if it exists). `watcher` sees each progress
    snapshot on the driver (tests use it to kill a worker mid-run)."""
    import ray

    from tokenflow_ray.tokenizer.training.checkpoint import read_position
    from tokenflow_ray.tokenizer.training.data import build_train_data

    cfg.check_local_files()  # a missing LPIPS / teacher file is a one-line error here, before any worker starts
    ensure_ray()
    # The data position of the run's latest checkpoint: the pipeline starts there (nothing is read and dropped).
    pos = read_position(run_dir(cfg))
    s = cfg.scaling.num_workers * cfg.data.batch_size
    needed = (max(0, cfg.schedule.steps - pos["step"]) * cfg.optim.accum_steps + 1) * s
    data = build_train_data(cfg.data, cfg.run.storage_dir, cfg.model.image_size, needed, offset=pos["samples"])
    progress = _progress_actor_cls().remote()
    trainer = build_trainer(cfg, data.dataset, progress,
                            {"indexed": data.indexed, "offset": data.offset, "num_rows": data.num_rows})
    box: dict = {}

    def fit() -> None:
        try:
            box["result"] = trainer.fit()
        except BaseException as exc:  # re-raised on the driver's main thread below
            box["error"] = exc

    thread = threading.Thread(target=fit, name="tokenizer-fit", daemon=True)
    thread.start()
    bar = _progress_bar(cfg.schedule.steps) if show_progress else None
    snap = ProgressSnapshot(0, cfg.schedule.steps, 0, {}, [], 0)
    try:
        while thread.is_alive():
            thread.join(poll_s)
            metrics, workers, attempts, checkpointed = ray.get(progress.snapshot.remote())
            snap = ProgressSnapshot(int(metrics.get("step", 0)), cfg.schedule.steps, checkpointed, metrics, workers,
                                    attempts)
            if bar is not None:
                bar.update(snap.step - bar.n)
                if metrics:
                    bar.set_postfix(loss=f"{metrics['loss']:.4f}", img_s=f"{metrics['images_per_s']:.0f}",
                                    usage=f"{metrics['usage']:.2f}", skipped=metrics["skipped_images"])
            if watcher is not None:
                watcher(snap)
    finally:
        if bar is not None:
            bar.close()
        ray.kill(progress)
    if "error" in box:
        raise box["error"]
    result = box["result"]
    ret = result.return_value or {}
    return TrainRun(metrics=dict(result.metrics or {}),
                    checkpoint_path=result.checkpoint.path if result.checkpoint else None, run_path=result.path,
                    loss_curve=ret.get("loss_curve", (result.metrics or {}).get("loss_curve", [])),
                    attempts=max(snap.attempts, 1))


def run_dir(cfg: TrainConfig) -> str:
    """Where Ray Train keeps this run (RunConfig(name, storage_path))."""
    storage = cfg.run.storage_dir
    return f"{storage.rstrip('/')}/{cfg.run.name}"


def _progress_bar(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="train", unit="step", dynamic_ncols=True)

"""Frozen, validated training configs and YAML loading: one tree.

`model` IS the tokenizer's own config tree (`tokenizer/config.py` TokenizerConfig): `model: {preset: NAME, ...}` is
that preset with any of its leaves replaced (`model.quantizer.codebook_size`, `model.loss.lpips_path`,
`model.semantic.pretrained_path` for the teacher checkpoint, `model.scales`, ...). Nothing is duplicated here: the
training image side is `model.image_size`, the GAN start is `model.loss.gan_start_step`. The other sections (data,
optim, schedule, scaling, eval, run) hold what only training needs. `--set a.b.c=VALUE` on the CLI reaches the same
leaves as the YAML.

Everything is checked at construction, on the driver, so a bad value (negative lr, K <= 1, unknown key or preset,
bad worker counts) is a one-line ValueError before any Ray worker starts. Nothing here imports torch or ray.
Presets: `tiny` (CPU tests), `tokenflow-b` (CLIP ViT-B/16 @224), `tokenflow-xl` (SigLIP-SO400M/14 @384).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

from tokenflow_ray.checks import require
from tokenflow_ray.tokenizer.config import TokenizerConfig, merge_tree

DATA_SOURCES = ("digits", "shapes", "parquet", "images")
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass(frozen=True)
class DataSettings:
    source: str = "digits"  # digits | shapes (generated parquet) | parquet (image-bytes column) | images (a folder)
    path: str | None = None  # parquet or image folder; for digits/shapes where to write them (None: under storage)
    column: str = "image"  # image-bytes column of a parquet source
    num_images: int = 512  # generated datasets only (training split)
    num_eval_images: int = 256  # generated datasets only: the held-out split (digits: from held-out source drawings)
    # Held-out split of a parquet/images source: eval_path when given, else this fraction of the files (chosen by a
    # hash of the file name, at least one file) that training never reads (split.py).
    eval_path: str | None = None
    holdout_fraction: float = 0.05
    batch_size: int = 16  # per worker
    # Rows shuffled in a buffer of this size in each worker's iterator (0: off); files are shuffled per epoch too.
    local_shuffle_buffer_size: int = 0
    # Training splits up to this size (encoded bytes) are read once and indexed: one pipeline for every epoch and an
    # exact resume; larger ones stream from storage, one pipeline per epoch (training/data.py).
    materialize_max_mb: int = 2048
    crop_scale_min: float = 0.8  # random-resized-crop area fraction (paper: 0.8-1.0); 1.0 = centre resize only
    hflip: bool = True
    map_workers: int = 1  # actors in the decode stage (bounded concurrency)
    map_cpus: float = 0.25  # CPUs per decode actor; fractional so 2 Train workers on 2 CPUs cannot starve it
    max_image_pixels: int = 4096 * 4096  # larger decoded images count as corrupt (decompression bombs)
    seed: int = 0

    def __post_init__(self) -> None:
        require(self.source in DATA_SOURCES, f"data.source must be one of {DATA_SOURCES}, got {self.source!r}")
        require(self.source in ("digits", "shapes") or bool(self.path), f"data.source {self.source!r} needs data.path")
        for name in ("num_images", "num_eval_images", "batch_size", "map_workers", "max_image_pixels",
                     "materialize_max_mb"):
            require(isinstance(getattr(self, name), int) and getattr(self, name) >= 1,
                    f"data.{name} must be a positive integer, got {getattr(self, name)!r}")
        require(0.0 < self.holdout_fraction < 1.0, f"data.holdout_fraction must be in (0, 1), got {self.holdout_fraction}")
        require(isinstance(self.local_shuffle_buffer_size, int) and self.local_shuffle_buffer_size >= 0,
                f"data.local_shuffle_buffer_size must be an integer >= 0, got {self.local_shuffle_buffer_size!r}")
        require(0.0 < self.crop_scale_min <= 1.0, f"data.crop_scale_min must be in (0, 1], got {self.crop_scale_min}")
        require(self.map_cpus > 0, f"data.map_cpus must be > 0, got {self.map_cpus}")


@dataclass(frozen=True)
class OptimSettings:
    lr: float = 1e-4  # Adam, paper §3
    betas: tuple[float, float] = (0.9, 0.95)
    disc_lr: float = 1e-4
    grad_clip: float = 1.0  # 0 disables
    ema_decay: float = 0.9999  # 0 disables the EMA copy
    # (The GAN is model.loss: gan_weight 0 turns the discriminator off, gan_start_step is when it starts.)
    # Micro-batches summed into each optimiser step: one gradient all-reduce per accum_steps micro-batches.
    accum_steps: int = 1

    def __post_init__(self) -> None:
        require(isinstance(self.accum_steps, int) and self.accum_steps >= 1,
                f"optim.accum_steps must be an integer >= 1, got {self.accum_steps!r}")
        for name in ("lr", "disc_lr"):
            value = getattr(self, name)
            require(isinstance(value, (int, float)) and math.isfinite(value) and value > 0,
                    f"optim.{name} must be a positive number, got {value!r}")
        require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), f"optim.betas must be two values in "
                                                                              f"[0, 1), got {self.betas}")
        require(self.grad_clip >= 0, f"optim.grad_clip must be >= 0, got {self.grad_clip}")
        require(0 <= self.ema_decay < 1, f"optim.ema_decay must be in [0, 1), got {self.ema_decay}")


@dataclass(frozen=True)
class ScheduleSettings:
    steps: int = 20  # total optimiser steps (global; each consumes accum_steps x batch_size images per worker)
    log_every: int = 5  # report metrics every N steps
    checkpoint_every: int = 10  # checkpoint every N steps (and at the end)
    keep_checkpoints: int = 2

    def __post_init__(self) -> None:
        for name in ("steps", "log_every", "checkpoint_every", "keep_checkpoints"):
            require(isinstance(getattr(self, name), int) and getattr(self, name) >= 1,
                    f"schedule.{name} must be a positive integer, got {getattr(self, name)!r}")


GRAD_COMPRESS = ("none", "bf16")
GRAD_SYNC = ("auto", "ddp", "flat")


@dataclass(frozen=True)
class ScalingSettings:
    num_workers: int = 2
    use_gpu: bool = False  # nccl on GPU, gloo on CPU
    cpus_per_worker: float = 0.5  # fractional: on a 2-CPU box whole CPUs per worker starve the data stage (deadlock)
    torch_threads: int = 1  # intra-op threads per worker; 1 keeps N workers from oversubscribing N cores
    max_failures: int = 1  # worker-group restarts (FailureConfig); each resumes from the latest checkpoint
    placement_strategy: str = "PACK"  # PACK fills a node first; SPREAD puts workers on different nodes
    # How gradients are averaged over workers. ddp: torch's DistributedDataParallel (bucketed all-reduce that
    # overlaps backward; right for large models on nccl); flat: one all-reduce of every gradient (generator and
    # discriminator) per optimiser step, after backward (a gloo call costs ~2 ms here however small, and DDP's
    # reducer ~10 ms a step more on the tiny model); auto: ddp on GPU, flat on CPU.
    grad_sync: str = "auto"
    # Gradient values on the wire: none (fp32) or bf16 (half the bytes; averaged in bf16, written back to fp32).
    grad_compress: str = "none"
    # Pin each worker to its own CPU(s) (torch_threads each) on its node: on a box with as many cores as workers,
    # stops the kernel moving workers between cores whenever a Ray process wakes (tokenflow_ray/affinity.py).
    pin_cpus: bool = False

    @property
    def gradient_sync(self) -> str:
        if self.grad_sync != "auto":
            return self.grad_sync
        return "ddp" if self.use_gpu else "flat"

    def __post_init__(self) -> None:
        require(self.grad_sync in GRAD_SYNC, f"scaling.grad_sync must be one of {GRAD_SYNC}, got {self.grad_sync!r}")
        require(self.grad_compress in GRAD_COMPRESS,
                f"scaling.grad_compress must be one of {GRAD_COMPRESS}, got {self.grad_compress!r}")
        require(self.grad_compress == "none" or self.gradient_sync == "flat" or self.use_gpu,
                "scaling.grad_compress=bf16 under DDP needs a GPU (torch's bf16 hook runs on NCCL only); "
                "use scaling.grad_sync=flat on CPU")
        require(isinstance(self.num_workers, int) and self.num_workers >= 1,
                f"scaling.num_workers must be an integer >= 1, got {self.num_workers!r}")
        require(self.cpus_per_worker > 0, f"scaling.cpus_per_worker must be > 0, got {self.cpus_per_worker}")
        require(self.torch_threads >= 1, f"scaling.torch_threads must be >= 1, got {self.torch_threads}")
        require(isinstance(self.max_failures, int) and self.max_failures >= -1,
                f"scaling.max_failures must be an integer >= -1 (-1 = unlimited), got {self.max_failures!r}")
        require(self.placement_strategy in PLACEMENT_STRATEGIES,
                f"scaling.placement_strategy must be one of {PLACEMENT_STRATEGIES}, got {self.placement_strategy!r}")


@dataclass(frozen=True)
class RunSettings:
    name: str = "tokenizer"  # with storage_path, identifies the run: rerunning the same pair resumes it
    storage_path: str = "~/tokenflow_runs"  # must be shared storage (NFS, S3) on a multi-node cluster

    def __post_init__(self) -> None:
        require(bool(self.name) and "/" not in self.name, f"run.name must be a non-empty name, got {self.name!r}")
        require(bool(self.storage_path), "run.storage_path must be set")

    @property
    def storage_dir(self) -> str:
        return str(Path(self.storage_path).expanduser()) if "://" not in self.storage_path else self.storage_path


@dataclass(frozen=True)
class EvalSettings:
    num_images: int = 256  # held-out images scored by `tokenflow tokenizer evaluate` (at most)
    batch_size: int = 32
    # rFID: torchmetrics' Frechet distance over the pooled features of a local transformers vision model (a CLIP,
    # SigLIP, DINOv2 or ViT directory; never downloaded). None: rFID is not computed (reported as null).
    fid_features: str | None = None

    def __post_init__(self) -> None:
        for name in ("num_images", "batch_size"):
            require(isinstance(getattr(self, name), int) and getattr(self, name) >= 1,
                    f"eval.{name} must be a positive integer, got {getattr(self, name)!r}")


_SECTIONS = {"data": DataSettings, "optim": OptimSettings, "schedule": ScheduleSettings, "scaling": ScalingSettings,
             "eval": EvalSettings, "run": RunSettings}


@dataclass(frozen=True)
class TrainConfig:
    model: TokenizerConfig = field(default_factory=lambda: TokenizerConfig.from_overrides({}))  # preset tiny
    data: DataSettings = field(default_factory=DataSettings)
    optim: OptimSettings = field(default_factory=OptimSettings)
    schedule: ScheduleSettings = field(default_factory=ScheduleSettings)
    scaling: ScalingSettings = field(default_factory=ScalingSettings)
    eval: EvalSettings = field(default_factory=EvalSettings)
    run: RunSettings = field(default_factory=RunSettings)

    def __post_init__(self) -> None:
        loss = self.model.loss
        require(loss.lpips_weight == 0 or bool(loss.lpips_path),
                f"model.loss.lpips_weight is {loss.lpips_weight} but model.loss.lpips_path is not set: give a local "
                "LPIPS state dict (docs/tokenizer-guide.md: LPIPS) or set model.loss.lpips_weight: 0")

    def tokenizer_config(self) -> TokenizerConfig:
        return self.model

    def check_local_files(self) -> None:
        """Files the run reads from a local path exist (on the driver; on a cluster they must exist on every node)."""
        from pathlib import Path

        for key, value in (("model.loss.lpips_path", self.model.loss.lpips_path if self.model.loss.lpips_weight
                            else None), ("model.semantic.pretrained_path", self.model.semantic.pretrained_path)):
            if value is not None and "://" not in value and not Path(value).expanduser().exists():
                raise FileNotFoundError(f"{key}: {value} does not exist (weights are read locally, never downloaded)")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **sections: dict) -> TrainConfig:
        """A copy with leaves of named sections replaced: cfg.replace(scaling={"num_workers": 1},
        model={"quantizer": {"codebook_size": 256}})."""
        return TrainConfig.from_dict(merge_tree(self.to_dict(), sections, "config"))

    @classmethod
    def from_dict(cls, data: dict) -> TrainConfig:
        require(isinstance(data, dict), "a training config must be a mapping of sections")
        known = {"model", *_SECTIONS}
        unknown = set(data) - known
        require(not unknown, f"unknown config sections {sorted(unknown)}; expected {sorted(known)}")
        kwargs = {"model": TokenizerConfig.from_overrides(data.get("model"))}
        for name, values in data.items():
            if name == "model":
                continue
            section = _SECTIONS[name]
            require(isinstance(values, dict), f"config section {name!r} must be a mapping")
            known = {f.name for f in dataclasses.fields(section)}
            bad = set(values) - known
            require(not bad, f"unknown keys in {name}: {sorted(bad)}; expected {sorted(known)}")
            kwargs[name] = section(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})
        return cls(**kwargs)


def parse_set(items: list[str] | None) -> dict:
    """`["model.quantizer.codebook_size=1024", "optim.lr=3e-4"]` -> a nested override dict (values parsed as YAML)."""
    import yaml

    out: dict = {}
    for item in items or []:
        key, sep, text = item.partition("=")
        require(bool(sep) and bool(key) and all(key.split(".")), f"--set expects KEY.PATH=VALUE, got {item!r}")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"--set {key}: not a YAML value ({exc})") from None
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" as a string; a number is what was meant
            try:
                value = float(value)
            except ValueError:
                pass
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
            require(isinstance(node, dict), f"--set {key}: {part} is set to a value and a mapping")
        node[leaf] = value
    return out


def _deep_update(base: dict, override: dict) -> dict:
    out = dict(base)
    for key, value in override.items():
        out[key] = _deep_update(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) \
            else value
    return out


def load_config(path: str | Path, sets: list[str] | None = None) -> TrainConfig:
    """The YAML at `path` with `--set` overrides applied (a dotted path reaches any leaf, model knobs included)."""
    import yaml

    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"config file not found: {file}")
    try:
        data = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ValueError(f"{file}: not valid YAML ({exc})") from exc
    try:
        if not isinstance(data, dict):
            raise ValueError("a training config must be a mapping of sections")
        return TrainConfig.from_dict(_deep_update(data, parse_set(sets)))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{file}: {exc}") from exc


def config_with_overrides(cfg: TrainConfig, workers: int | None = None, storage: str | None = None,
                          name: str | None = None) -> TrainConfig:
    """The CLI flags (--workers, --storage, --name) applied on top of a loaded config."""
    scaling = {"num_workers": workers} if workers is not None else {}
    run = {k: v for k, v in (("storage_path", storage), ("name", name)) if v is not None}
    return cfg.replace(scaling=scaling, run=run)

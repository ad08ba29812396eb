"""Frozen, validated training configs (data, model, optimiser, schedule, scaling, run) and YAML loading.

Everything is checked at construction, on the driver, so a bad value (negative lr, K <= 0, unknown teacher or preset,
bad worker counts) is a one-line ValueError before any Ray worker starts. Nothing here imports torch or ray.
Presets: `tiny` (CPU tests), `tokenflow-b` (CLIP ViT-B/16 @224), `tokenflow-xl` (SigLIP-SO400M/14 @384).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..config import PRESETS, TokenizerConfig, preset

DATA_SOURCES = ("digits", "shapes", "parquet", "images")
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
# teacher name -> the semantic tower kind it needs; "random" keeps the preset's tower, randomly initialised (tests).
TEACHERS = {"random": None, "clipb_224": "clip", "siglip_384": "siglip"}


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


@dataclass(frozen=True)
class ModelSettings:
    preset: str = "tiny"  # a tokenizer preset name (tokenizer/config.py PRESETS)
    teacher: str = "random"  # random | clipb_224 | siglip_384
    teacher_path: str | None = None  # local transformers checkpoint of the teacher (nothing is downloaded)
    codebook_size: int | None = None  # K; None keeps the preset's

    def __post_init__(self) -> None:
        _check(self.preset in PRESETS, f"model.preset: unknown preset {self.preset!r}; choose from {sorted(PRESETS)}")
        _check(self.teacher in TEACHERS, f"model.teacher: unknown teacher {self.teacher!r}; choose from {sorted(TEACHERS)}")
        _check(self.codebook_size is None or (isinstance(self.codebook_size, int) and self.codebook_size > 0),
               f"model.codebook_size (K) must be a positive integer, got {self.codebook_size!r}")
        if self.teacher != "random":
            _check(bool(self.teacher_path), f"model.teacher {self.teacher!r} needs model.teacher_path: a local "
                                            "transformers checkpoint directory (weights are never downloaded)")

    def tokenizer_config(self) -> TokenizerConfig:
        base = preset(self.preset)
        kind = TEACHERS[self.teacher]
        _check(kind is None or kind == base.semantic.kind,
               f"model.teacher {self.teacher!r} needs a {kind} tower, but preset {self.preset!r} uses "
               f"{base.semantic.kind!r}")
        semantic = dataclasses.replace(base.semantic, pretrained_path=self.teacher_path)
        # K is validated by QuantizerConfig too (K >= 2), so K = 1 also fails here with its message.
        quantizer = (base.quantizer if self.codebook_size is None
                     else dataclasses.replace(base.quantizer, codebook_size=self.codebook_size))
        return dataclasses.replace(base, semantic=semantic, quantizer=quantizer)


@dataclass(frozen=True)
class DataSettings:
    source: str = "digits"  # digits | shapes (generated parquet) | parquet (image-bytes column) | images (a folder)
    path: str | None = None  # parquet or image folder; for digits/shapes where to write them (None: under storage)
    column: str = "image"  # image-bytes column of a parquet source
    num_images: int = 512  # generated datasets only
    image_size: int = 16  # side after crop + resize; a multiple of the tokenizer's side_multiple
    batch_size: int = 16  # per worker
    crop_scale_min: float = 0.8  # random-resized-crop area fraction (paper: 0.8-1.0); 1.0 = centre resize only
    hflip: bool = True
    map_workers: int = 1  # actors in the decode stage (bounded concurrency)
    map_cpus: float = 0.25  # CPUs per decode actor; fractional so 2 Train workers on 2 CPUs cannot starve it
    max_image_pixels: int = 4096 * 4096  # larger decoded images count as corrupt (decompression bombs)
    seed: int = 0

    def __post_init__(self) -> None:
        _check(self.source in DATA_SOURCES, f"data.source must be one of {DATA_SOURCES}, got {self.source!r}")
        _check(self.source in ("digits", "shapes") or bool(self.path), f"data.source {self.source!r} needs data.path")
        for name in ("num_images", "image_size", "batch_size", "map_workers", "max_image_pixels"):
            _check(isinstance(getattr(self, name), int) and getattr(self, name) >= 1,
                   f"data.{name} must be a positive integer, got {getattr(self, name)!r}")
        _check(0.0 < self.crop_scale_min <= 1.0, f"data.crop_scale_min must be in (0, 1], got {self.crop_scale_min}")
        _check(self.map_cpus > 0, f"data.map_cpus must be > 0, got {self.map_cpus}")


@dataclass(frozen=True)
class OptimSettings:
    lr: float = 1e-4  # Adam, paper §3
    betas: tuple[float, float] = (0.9, 0.95)
    disc_lr: float = 1e-4
    grad_clip: float = 1.0  # 0 disables
    ema_decay: float = 0.9999  # 0 disables the EMA copy
    gan: bool = True  # train the PatchGAN discriminator (second optimiser) once gan_start_step is reached
    gan_start_step: int | None = None  # None keeps the preset's (paper: 20000; tiny: 0)
    # Micro-batches summed into each optimiser step: one gradient all-reduce per accum_steps micro-batches.
    accum_steps: int = 1

    def __post_init__(self) -> None:
        _check(isinstance(self.accum_steps, int) and self.accum_steps >= 1,
               f"optim.accum_steps must be an integer >= 1, got {self.accum_steps!r}")
        for name in ("lr", "disc_lr"):
            value = getattr(self, name)
            _check(isinstance(value, (int, float)) and math.isfinite(value) and value > 0,
                   f"optim.{name} must be a positive number, got {value!r}")
        _check(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), f"optim.betas must be two values in "
                                                                             f"[0, 1), got {self.betas}")
        _check(self.grad_clip >= 0, f"optim.grad_clip must be >= 0, got {self.grad_clip}")
        _check(0 <= self.ema_decay < 1, f"optim.ema_decay must be in [0, 1), got {self.ema_decay}")
        _check(self.gan_start_step is None or self.gan_start_step >= 0, "optim.gan_start_step must be >= 0")


@dataclass(frozen=True)
class ScheduleSettings:
    steps: int = 20  # total optimiser steps (global; each consumes accum_steps x batch_size images per worker)
    log_every: int = 5  # report metrics every N steps
    checkpoint_every: int = 10  # checkpoint every N steps (and at the end)
    keep_checkpoints: int = 2

    def __post_init__(self) -> None:
        for name in ("steps", "log_every", "checkpoint_every", "keep_checkpoints"):
            _check(isinstance(getattr(self, name), int) and getattr(self, name) >= 1,
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
    # stops the kernel moving workers between cores whenever a Ray process wakes (training/affinity.py).
    pin_cpus: bool = False

    @property
    def gradient_sync(self) -> str:
        if self.grad_sync != "auto":
            return self.grad_sync
        return "ddp" if self.use_gpu else "flat"

    def __post_init__(self) -> None:
        _check(self.grad_sync in GRAD_SYNC, f"scaling.grad_sync must be one of {GRAD_SYNC}, got {self.grad_sync!r}")
        _check(self.grad_compress in GRAD_COMPRESS,
               f"scaling.grad_compress must be one of {GRAD_COMPRESS}, got {self.grad_compress!r}")
        _check(self.grad_compress == "none" or self.gradient_sync == "flat" or self.use_gpu,
               "scaling.grad_compress=bf16 under DDP needs a GPU (torch's bf16 hook runs on NCCL only); "
               "use scaling.grad_sync=flat on CPU")
        _check(isinstance(self.num_workers, int) and self.num_workers >= 1,
               f"scaling.num_workers must be an integer >= 1, got {self.num_workers!r}")
        _check(self.cpus_per_worker > 0, f"scaling.cpus_per_worker must be > 0, got {self.cpus_per_worker}")
        _check(self.torch_threads >= 1, f"scaling.torch_threads must be >= 1, got {self.torch_threads}")
        _check(isinstance(self.max_failures, int) and self.max_failures >= -1,
               f"scaling.max_failures must be an integer >= -1 (-1 = unlimited), got {self.max_failures!r}")
        _check(self.placement_strategy in PLACEMENT_STRATEGIES,
               f"scaling.placement_strategy must be one of {PLACEMENT_STRATEGIES}, got {self.placement_strategy!r}")


@dataclass(frozen=True)
class RunSettings:
    name: str = "tokenizer"  # with storage_path, identifies the run: rerunning the same pair resumes it
    storage_path: str = "~/tokenflow_runs"  # must be shared storage (NFS, S3) on a multi-node cluster

    def __post_init__(self) -> None:
        _check(bool(self.name) and "/" not in self.name, f"run.name must be a non-empty name, got {self.name!r}")
        _check(bool(self.storage_path), "run.storage_path must be set")

    @property
    def storage_dir(self) -> str:
        return str(Path(self.storage_path).expanduser()) if "://" not in self.storage_path else self.storage_path


_SECTIONS = {"model": ModelSettings, "data": DataSettings, "optim": OptimSettings, "schedule": ScheduleSettings,
             "scaling": ScalingSettings, "run": RunSettings}


@dataclass(frozen=True)
class TrainConfig:
    model: ModelSettings = field(default_factory=ModelSettings)
    data: DataSettings = field(default_factory=DataSettings)
    optim: OptimSettings = field(default_factory=OptimSettings)
    schedule: ScheduleSettings = field(default_factory=ScheduleSettings)
    scaling: ScalingSettings = field(default_factory=ScalingSettings)
    run: RunSettings = field(default_factory=RunSettings)

    def __post_init__(self) -> None:
        tok = self.tokenizer_config()  # builds and validates the model config on the driver (no torch)
        _check(self.data.image_size % tok.side_multiple == 0,
               f"data.image_size {self.data.image_size} must be a multiple of {tok.side_multiple} for preset "
               f"{self.model.preset!r}")

    def tokenizer_config(self) -> TokenizerConfig:
        tok = self.model.tokenizer_config()
        loss = tok.loss
        if not self.optim.gan:
            loss = dataclasses.replace(loss, gan_weight=0.0)
        if self.optim.gan_start_step is not None:
            loss = dataclasses.replace(loss, gan_start_step=self.optim.gan_start_step)
        return dataclasses.replace(tok, loss=loss)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **sections: dict) -> TrainConfig:
        """A copy with fields of named sections replaced: cfg.replace(scaling={"num_workers": 1})."""
        merged = self.to_dict()
        for name, values in sections.items():
            _check(name in _SECTIONS, f"unknown config section {name!r}")
            merged[name].update(values)
        return TrainConfig.from_dict(merged)

    @classmethod
    def from_dict(cls, data: dict) -> TrainConfig:
        _check(isinstance(data, dict), "a training config must be a mapping of sections")
        unknown = set(data) - set(_SECTIONS)
        _check(not unknown, f"unknown config sections {sorted(unknown)}; expected {sorted(_SECTIONS)}")
        kwargs = {}
        for name, values in data.items():
            section = _SECTIONS[name]
            _check(isinstance(values, dict), f"config section {name!r} must be a mapping")
            known = {f.name for f in dataclasses.fields(section)}
            bad = set(values) - known
            _check(not bad, f"unknown keys in {name}: {sorted(bad)}; expected {sorted(known)}")
            kwargs[name] = section(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})
        return cls(**kwargs)


def load_config(path: str | Path) -> TrainConfig:
    import yaml

    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"config file not found: {file}")
    try:
        data = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ValueError(f"{file}: not valid YAML ({exc})") from exc
    try:
        return TrainConfig.from_dict(data)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{file}: {exc}") from exc


def config_with_overrides(cfg: TrainConfig, workers: int | None = None, storage: str | None = None,
                          name: str | None = None) -> TrainConfig:
    """The CLI flags (--workers, --storage, --name) applied on top of a loaded config."""
    scaling = {"num_workers": workers} if workers is not None else {}
    run = {k: v for k, v in (("storage_path", storage), ("name", name)) if v is not None}
    return cfg.replace(scaling=scaling, run=run)

"""Defaults that depend on the device the engine runs on, resolved once, before the engine (or anything else)
reads the config: the block size on CUDA with flash-attn, and overlapped scheduling when left to the device.

Pure Python at import (serve/config.py resolves a fleet's config in a driver that loads no torch): the facts come
in as a `DeviceFacts`, from where the engine runs (`local_device_facts`, imports torch) or, for Serve replicas
that do not run yet, from what they will be given (serve/config.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from tokenflow_ray.engine.config import FLASH_BLOCK_SIZE, CacheConfig, EngineConfig

log = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = CacheConfig().block_size


@dataclass(frozen=True)
class DeviceFacts:
    cuda: bool  # the engine runs on a CUDA device
    flash_attn: bool  # flash-attn is importable there


def gpu_cache_defaults(config: EngineConfig, cuda: bool, flash: bool) -> EngineConfig:
    """On CUDA with flash-attn importable and the attention backend on auto, the default block size becomes one
    flash-attn's paged kernel takes, with the pool's token capacity kept: flash-attn (and the decode CUDA graphs it
    allows) is then what a default config runs. A block size set by hand is left alone (SDPA then, as before)."""
    cc = config.cache
    if not (cuda and flash and config.model.attention_backend == "auto" and cc.block_size == DEFAULT_BLOCK_SIZE):
        return config
    blocks = max(1, cc.num_device_blocks * cc.block_size // FLASH_BLOCK_SIZE)
    host = -(-cc.num_host_blocks * cc.block_size // FLASH_BLOCK_SIZE)
    log.info("CUDA + flash-attn: block_size %d -> %d (%d device blocks)", cc.block_size, FLASH_BLOCK_SIZE, blocks)
    return replace(config, cache=replace(cc, block_size=FLASH_BLOCK_SIZE, num_device_blocks=blocks,
                                         num_host_blocks=host))


def resolve_device_defaults(config: EngineConfig, facts: DeviceFacts) -> EngineConfig:
    """The config the engine runs on. Resolving twice changes nothing (a resolved config has no default left)."""
    config = gpu_cache_defaults(config, facts.cuda, facts.flash_attn)
    if config.overlap_scheduling is None:  # by the device: see EngineConfig
        config = replace(config, overlap_scheduling=facts.cuda)
    return config


def local_device_facts(device: str) -> DeviceFacts:
    """The facts of this process, for an engine on `device` (auto, cpu, cuda[:N]); imports torch."""
    from tokenflow_ray.layers.attention_select import flash_attn_available
    from tokenflow_ray.runner.model_runner import resolve_device

    cuda = resolve_device(device).type == "cuda"
    return DeviceFacts(cuda=cuda, flash_attn=cuda and flash_attn_available())

"""Defaults that depend on the device are resolved once, where the engine is built (runner/factory.py), before
the engine reads the config; the runner takes the config as resolved."""

from __future__ import annotations

import dataclasses

from tokenflow_ray.engine.config import FLASH_BLOCK_SIZE, EngineConfig, ModelConfig
from tokenflow_ray.runner.device_defaults import DeviceFacts, resolve_device_defaults

CPU, CUDA_FLASH = DeviceFacts(cuda=False, flash_attn=False), DeviceFacts(cuda=True, flash_attn=True)


def test_overlap_scheduling_is_resolved_by_the_device(embedded_dir):
    """None (the default): on with a CUDA runner, off on CPU; a value set by hand is kept."""
    from tokenflow_ray.runner.factory import build_engine

    base = EngineConfig(model=ModelConfig(model=str(embedded_dir), dtype="float32", device="cpu",
                                          fused_cpu_ops=False, cpu_prepack=False))
    assert base.overlap_scheduling is None
    assert build_engine(base).config.overlap_scheduling is False
    assert build_engine(dataclasses.replace(base, overlap_scheduling=True)).config.overlap_scheduling is True
    assert resolve_device_defaults(base, CPU).overlap_scheduling is False
    assert resolve_device_defaults(base, CUDA_FLASH).overlap_scheduling is True


def test_resolving_twice_changes_nothing():
    """A config resolved for the fleet (serve/config.py) is what the replica's factory resolves again."""
    once = resolve_device_defaults(EngineConfig(), CUDA_FLASH)
    assert once.cache.block_size == FLASH_BLOCK_SIZE and once.overlap_scheduling is True
    assert resolve_device_defaults(once, CUDA_FLASH) == once
    assert resolve_device_defaults(once, CPU) == once  # nothing left to default

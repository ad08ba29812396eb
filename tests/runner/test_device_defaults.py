"""Defaults that depend on the device are resolved once, by the runner, before the engine reads the config."""

from __future__ import annotations

import dataclasses


def test_overlap_scheduling_is_resolved_by_the_device(embedded_dir):
    """None (the default): on with a CUDA runner, off on CPU; a value set by hand is kept."""
    from tokenflow_ray.engine.config import EngineConfig, ModelConfig
    from tokenflow_ray.runner.model_runner import TorchModelRunner

    base = EngineConfig(model=ModelConfig(model=str(embedded_dir), dtype="float32", device="cpu",
                                          fused_cpu_ops=False, cpu_prepack=False))
    assert base.overlap_scheduling is None
    assert TorchModelRunner(base).config.overlap_scheduling is False
    assert TorchModelRunner(dataclasses.replace(base, overlap_scheduling=True)).config.overlap_scheduling is True

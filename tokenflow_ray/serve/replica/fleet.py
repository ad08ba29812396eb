"""A mixed fleet (ServeConfig.device_blocks_by_rank): the replica of Serve rank i holds a device pool of its own,
as replicas on GPUs of different memory do."""

from __future__ import annotations

from dataclasses import replace

from tokenflow_ray.engine.config import EngineConfig


def engine_config_for_rank(engine_config: EngineConfig, device_blocks_by_rank: tuple[int, ...],
                           rank: int) -> EngineConfig:
    """A mixed fleet's replica at Serve rank `rank`: its rank's device pool, ranks past the list the fleet's own."""
    if not 0 <= rank < len(device_blocks_by_rank):
        return engine_config
    return replace(engine_config, cache=replace(engine_config.cache, num_device_blocks=device_blocks_by_rank[rank]))

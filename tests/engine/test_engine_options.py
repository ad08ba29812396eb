"""EngineConfig.with_options: engine options by name, each set on the config that declares it."""

from __future__ import annotations

import pytest

from tokenflow_ray.engine.config import CacheConfig, EngineConfig, ModelConfig


def test_each_option_goes_to_the_config_that_declares_it():
    c = EngineConfig().with_options(model="m", dtype="float32", num_host_blocks=8, block_size=32, policy="andes",
                                    max_num_seqs=4, record_history=5, overlap_scheduling=False)
    assert (c.model.model, c.model.dtype) == ("m", "float32")
    assert (c.cache.num_host_blocks, c.cache.block_size) == (8, 32)
    assert (c.scheduler.policy, c.scheduler.max_num_seqs) == ("andes", 4)
    assert (c.record_history, c.overlap_scheduling) == (5, False)
    assert EngineConfig().with_options() == EngineConfig()


def test_parts_as_mappings_or_configs_and_nested_configs_as_mappings():
    base = EngineConfig(cache=CacheConfig(num_host_blocks=4096))
    c = base.with_options(cache={"num_device_blocks": 16}, scheduler={"tokenflow": {"mu": 3.0}})
    assert (c.cache.num_device_blocks, c.cache.num_host_blocks) == (16, 4096)  # the rest of the part is kept
    assert c.scheduler.tokenflow.mu == 3.0 and c.scheduler.tokenflow.delta_t == base.scheduler.tokenflow.delta_t
    assert base.with_options(model=ModelConfig(model="x")).model.model == "x"
    # A part's options are set together: a preset is valid with its load format, whatever the order given.
    assert EngineConfig().with_options(model="llama3-8b", load_format="dummy").model.load_format == "dummy"


@pytest.mark.parametrize("options, message", [
    ({"max_seqs": 4}, "unknown engine option 'max_seqs'"),
    ({"cache": {"blocks": 4}}, "cache: unknown option 'blocks'"),
    ({"policy": "fcfs", "scheduler": {"policy": "andes"}}, "policy: given twice"),
    ({"num_device_blocks": 0}, "num_device_blocks: must be positive"),
    ({"policy": "nope"}, "policy: unknown policy"),
    ({"record_history": -1}, "record_history"),
    ({"model": "llama3-8b"}, "load_format='dummy'"),  # checked as a whole: with load_format="dummy" it is fine
])
def test_bad_options_are_clear_errors(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig().with_options(**options)

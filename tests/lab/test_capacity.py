"""The decode-capacity calibration: its sizing arithmetic, and a run through the engine with the fake runner."""

from __future__ import annotations

import pytest

from tokenflow_ray.engine.fake_runner import FakeRunner
from tokenflow_ray.engine.llm_engine import LLMEngine
from tokenflow_ray.lab.capacity import CapacityConfig, measure_decode_capacity


def test_batch_is_what_the_pool_holds_at_full_length():
    cfg = CapacityConfig(num_device_blocks=294, mean_prompt_len=64, mean_output_len=256)
    assert cfg.batch == 294 // 20  # 320 tokens = 20 blocks of 16 a stream
    assert CapacityConfig(num_device_blocks=10_000, mean_prompt_len=64, mean_output_len=256,
                          max_num_seqs=32).batch == 32
    # The window sits around the mean context, and prompt + every generated token fits the full length.
    assert cfg.calib_prompt_len + cfg.max_tokens <= cfg.full_len
    centre = cfg.calib_prompt_len + 1 + cfg.warmup_steps + cfg.timed_steps / 2
    assert centre == pytest.approx(64 + 256 / 2, abs=2)
    short = CapacityConfig(num_device_blocks=40, mean_prompt_len=16, mean_output_len=40, decode_steps=96)
    assert short.timed_steps < 96 and short.calib_prompt_len + short.max_tokens <= short.full_len


def test_validation():
    with pytest.raises(ValueError, match="cannot hold"):
        CapacityConfig(num_device_blocks=4, mean_prompt_len=64, mean_output_len=256)
    with pytest.raises(ValueError, match="no timed step"):
        CapacityConfig(num_device_blocks=100, mean_prompt_len=16, mean_output_len=9)
    with pytest.raises(ValueError, match="decode_steps"):
        CapacityConfig(num_device_blocks=100, mean_prompt_len=16, mean_output_len=64, decode_steps=0)


def test_fake_runner_calibration_decodes_the_whole_batch():
    cfg = CapacityConfig(num_device_blocks=60, num_host_blocks=120, mean_prompt_len=24, mean_output_len=56,
                         max_num_batched_tokens=64, decode_steps=20, warmup_steps=2)
    engines = []

    def factory(config):
        runner = FakeRunner(config.cache.num_device_blocks, config.cache.block_size,
                            num_host_blocks=config.cache.num_host_blocks)
        engines.append(LLMEngine(config, runner, tokenizer=None))
        return engines[-1]

    lines = []
    cap = measure_decode_capacity(cfg, engine_factory=factory, progress=lines.append)
    assert cap.batch == 60 // 5 == 12 and cap.timed_steps == 20  # 80 tokens = 5 blocks a stream
    assert cap.tok_s > 0 and cap.median_step_tok_s > 0 and len(cap.window_tok_s) == 3
    assert engines[0].stats().preemptions == 0  # the batch fits: the figure is decode, not preemption
    assert engines[0].scheduler.num_unfinished == 12  # nobody finished inside the window
    assert "Γ" in lines[0]
    d = cap.to_dict()
    assert d["config"]["num_device_blocks"] == 60 and "method" in d

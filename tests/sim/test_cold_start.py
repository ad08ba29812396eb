"""What the measured engine pays for what is not yet warm (sim/cold_start.py), its copies' ordering, and the
profile of the engine as measured on an H200 (`--gpu h200-measured`, `--length-scale`)."""

from __future__ import annotations

import json

import pytest

from tokenflow_ray.cli import main
from tokenflow_ray.engine.plan import BlockCopy, ScheduledChunk, StepPlan
from tokenflow_ray.engine.runner_api import ModelInfo
from tokenflow_ray.engine.step_time_model import StepTimeFit
from tokenflow_ray.sim.cold_start import ColdStart, ColdState, new_shape_counts, shape_keys
from tokenflow_ray.sim.cost import CalibratedStepCost, HostLink
from tokenflow_ray.sim.hardware import MEASURED, deployment
from tokenflow_ray.sim.setups import gpu_replica_setup, paper_setup, setup_requests
from tokenflow_ray.sim.sim_runner import SimRunner


def _chunk(sid: str, n: int, start: int) -> ScheduledChunk:
    return ScheduledChunk(stream_id=sid, token_ids=(1,) * n, start_pos=start, new_blocks=(), first_block=0,
                          sample=True)


def _plan(decode_starts: tuple[int, ...], prefills: tuple[tuple[int, int], ...] = (), **copies) -> StepPlan:
    return StepPlan(step_id=0, decodes=tuple(_chunk(f"d{i}", 1, s) for i, s in enumerate(decode_starts)),
                    prefills=tuple(_chunk(f"p{i}", n, s) for i, (n, s) in enumerate(prefills)), **copies)


def test_a_steps_shapes_are_its_batch_and_table_width_and_its_chunks():
    plan = _plan((3, 40, 17), prefills=((12, 0), (8, 30)))
    # decodes: batch 3, the longest context (position 40) needs 3 blocks of 16; a whole prompt; a later chunk.
    assert shape_keys(plan, 16) == [(0, 3, 3), (1, 12), (2, 8, 38)]
    assert shape_keys(_plan((), prefills=((12, 0),)), 16) == [(1, 12)]


def test_each_new_shape_is_paid_once_per_process_and_the_first_step_once():
    cold = ColdStart(decode_shape_s=0.05, prefill_shape_s=0.07, first_step_s=0.5)
    state = ColdState(cold, 16)
    same = _plan((3, 40), prefills=((12, 0), (12, 0)))  # two prompts of one shape in one step: one new shape
    assert state.step_s(same, 0.01, None) == pytest.approx(0.01 + 0.5 + 0.05 + 0.07)
    assert state.step_s(same, 0.01, None) == pytest.approx(0.01)  # nothing new
    assert state.step_s(_plan((3, 48)), 0.01, None) == pytest.approx(0.06)  # a block boundary: a new width
    assert state.step_s(_plan((3,)), 0.01, None) == pytest.approx(0.06)  # a new batch size
    assert (state.cold_steps, state.steps) == (3, 4)
    assert new_shape_counts([[(0, 2, 3), (1, 5), (1, 5)], [(0, 2, 3)], [(0, 2, 4)]]) == [(1, 1), (0, 0), (1, 0)]


def test_the_pace_scales_every_step_by_time_since_the_run_began():
    state = ColdState(ColdStart(speed=((0.0, 1.5), (10.0, 1.0), (20.0, 0.8))), 16)
    state.start_run(100.0)
    plan = _plan((3,))
    assert [state.step_s(plan, 0.02, t) for t in (99.0, 105.0, 112.0, 125.0)] == \
        pytest.approx([0.02, 0.03, 0.02, 0.016])  # before the run: the law's pace
    with pytest.raises(ValueError, match="time order"):
        ColdStart(speed=((5.0, 1.0), (1.0, 1.0)))
    with pytest.raises(ValueError, match="first_step_s"):
        ColdStart(first_step_s=-1.0)


def test_without_duplex_loads_wait_for_the_steps_evictions():
    info = ModelInfo("m", vocab_size=100, max_model_len=4096, eos_token_ids=frozenset(), kv_bytes_per_token=1000)
    law = CalibratedStepCost(StepTimeFit(0.001, 0.0, 1e-6))
    copies = {"swap_out": (BlockCopy("x", 1, 0),), "write_through": (BlockCopy("y", 2, 1),),
              "swap_in": (BlockCopy("z", 3, 2),)}
    plan = _plan((3,), **copies)
    duplex = SimRunner(info, law, 10, HostLink(1e6, bidir_factor=0.5)).execute(plan)
    serial = SimRunner(info, law, 10, HostLink(1e6, duplex=False)).execute(plan)
    assert duplex.copy_s == pytest.approx(2 * 0.02)  # 10 kB blocks: 2 out beside 1 in, each way at half the link
    assert serial.copy_s == pytest.approx(3 * 0.01)  # one after the other at the full link
    assert serial.step_s == pytest.approx(max(serial.compute_s, serial.copy_s))


def test_length_scale_shrinks_lengths_as_the_h200_runs_were_made_and_the_pools_with_them():
    setup = paper_setup("h200-measured", "a")
    full = setup_requests(setup, seed=0)
    eighth = setup_requests(setup, seed=0, length_scale=0.125)
    assert len(full) == len(eighth) == 400 and setup.output_factor == 2.0
    for f, e in zip(full, eighth):
        assert e.prompt_len == max(8, round(f.prompt_len / 8)) and e.output_len == max(16, round(f.output_len / 8))
    cfg = gpu_replica_setup("h200-measured", "llama3-8b", "tokenflow", length_scale=0.125).engine
    assert (cfg.cache.num_device_blocks, cfg.cache.num_host_blocks) == (1734, 6936)  # the runs' pools
    with pytest.raises(ValueError, match="length_scale"):
        setup_requests(setup, length_scale=2.0)


def test_the_measured_profile_is_the_engine_as_fitted():
    m = MEASURED["h200-measured"]
    tf = gpu_replica_setup("h200-measured", "llama3-8b", "tokenflow")
    assert isinstance(tf.cost, CalibratedStepCost) and tf.cost.fit.fixed_s == m.laws["tokenflow"][0]
    assert gpu_replica_setup("h200-measured", "llama3-8b", "andes").cost == tf.cost  # never measured: tokenflow's
    assert gpu_replica_setup("h200-measured", "llama3-8b", "fcfs").cost.fit.fixed_s == m.laws["fcfs"][0]
    assert tf.cold.decode_shape_s == m.decode_shape_s and not tf.link.duplex and tf.cpu_overhead_s == 0.0
    with pytest.raises(ValueError, match="no deployment"):
        deployment("h200-measured", "qwen2.5-32b")


def test_simulate_runs_the_measured_profile_at_a_length_scale(tmp_path):
    out = tmp_path / "m.json"
    assert main(["simulate", "--gpu", "h200-measured", "--setup", "a", "--length-scale", "0.125", "--requests",
                 "12", "--policy", "fcfs,tokenflow", "--no-progress", "--json", str(out)]) == 0
    run = json.loads(out.read_text())
    assert run["setup"]["length_scale"] == 0.125 and run["setup"]["num_requests"] == 12
    assert run["policies"]["tokenflow"]["num_finished"] == 12 and run["policies"]["fcfs"]["completion_s"] > 0
    assert main(["simulate", "--table", "--length-scale", "0.5", "--no-progress"]) == 2  # one setup only



def test_what_if_takes_one_cost_out_of_the_measured_engine():
    free = gpu_replica_setup("h200-measured", "llama3-8b", "tokenflow", what_if=("no_shape_cost", "fcfs_law"))
    m = MEASURED["h200-measured"]
    assert free.cold.decode_shape_s == free.cold.prefill_shape_s == 0.0 and free.cold.first_step_s == m.first_step_s
    assert free.cost.fit.fixed_s == m.laws["fcfs"][0]
    with pytest.raises(ValueError, match="measured profile"):
        gpu_replica_setup("h200", "llama3-8b", "tokenflow", what_if=("fcfs_law",))
    with pytest.raises(ValueError, match="unknown"):
        gpu_replica_setup("h200-measured", "llama3-8b", "tokenflow", what_if=("faster",))

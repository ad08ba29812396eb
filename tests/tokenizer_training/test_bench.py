"""The training bench's own pieces: its config checks and the no-Ray ceiling measurement (a real, short run)."""

import pytest

from tokenflow_ray.tokenizer.training.bench import TrainBenchConfig
from tokenflow_ray.tokenizer.training.ceiling import measure_ceiling


@pytest.mark.parametrize("kwargs", [{"steps": 3}, {"steps": 2}, {"accum_steps": 0}, {"workers": ()}, {"batch_size": 0}])
def test_bench_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        TrainBenchConfig(**kwargs)


def test_ceiling_runs_the_training_step_in_separate_processes():
    result = measure_ceiling((1, 2), batch_size=4, steps=2)
    assert set(result) == {1, 2} and all(v > 0 for v in result.values())

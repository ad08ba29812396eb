"""The training bench's own pieces: its config checks and the no-Ray ceiling measurement (a real, short run)."""

import pytest

from tokenflow_ray.tokenizer.training.bench import TrainBenchConfig, summarize, train_config
from tokenflow_ray.tokenizer.training.ceiling import measure_ceiling


@pytest.mark.parametrize("kwargs", [{"steps": 3}, {"steps": 2}, {"accum_steps": 0}, {"workers": ()}, {"batch_size": 0}, {"repeats": 0}])
def test_bench_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        TrainBenchConfig(**kwargs)


def test_ceiling_runs_the_training_step_in_separate_processes():
    result = measure_ceiling((1, 2), batch_size=4, steps=2)
    assert set(result) == {1, 2} and all(v > 0 for v in result.values())


def test_summary_takes_medians_over_rounds_and_keeps_them():
    def run(images_per_s, sync):
        return {"images_per_s": images_per_s, "step_time_s": 16 / images_per_s, "sync_time_s": sync,
                "data_wait_s": 0.001, "data_wait_frac": 0.02}

    rounds = [{1: run(400, 0.0), 2: run(600, 0.004)}, {1: run(500, 0.0), 2: run(850, 0.003)},
              {1: run(300, 0.0), 2: run(510, 0.005)}]
    out = summarize(rounds, (1, 2))
    assert out["train_images_s"] == {1: 400, 2: 600}
    assert out["train_sync_time_s"][2] == 0.004
    assert out["train_speedup_2v1_rounds"] == pytest.approx([1.5, 1.7, 1.7])
    assert out["train_speedup_2v1"] == pytest.approx(1.7)  # median of the per-round ratios, not the ratio of the medians (1.5)
    assert out["train_rounds"] == rounds
    assert "train_vs_ceiling" not in out  # no ceiling measured in these rounds: nothing is made up


def test_summary_gives_vs_ceiling_and_epoch_ratio_per_round():
    def run(images_per_s):
        return {"images_per_s": images_per_s, "step_time_s": 0.04, "sync_time_s": 0.0, "data_wait_s": 0.0,
                "data_wait_frac": 0.0}

    rounds = [{1: run(400), 2: run(720), "ceiling": {1: 450, 2: 900}, "epochs3": run(700)},
              {1: run(400), 2: run(640), "ceiling": {1: 450, 2: 810}, "epochs3": run(660)},
              {1: run(400), 2: run(700), "ceiling": {1: 450, 2: 720}, "epochs3": run(700)}]
    out = summarize(rounds, (1, 2))
    assert out["train_vs_ceiling_rounds"] == pytest.approx([0.9, 0.888889, 1.09375], rel=1e-4)
    assert out["train_vs_ceiling"] == pytest.approx(0.9)
    assert out["train_epochs_ratio"] == pytest.approx(1.0)


def test_bench_runs_cover_one_epoch_and_use_the_chosen_sync():
    cfg = TrainBenchConfig(steps=10, batch_size=4, repeats=1, accum_steps=2, grad_compress="bf16")
    assert cfg.num_images() >= 10 * 4 * 2 * 2  # steps x batch x accum x workers
    assert cfg.num_images(3) * 3 <= cfg.num_images() + 4 * 4  # a third: the run makes 3 passes
    tc = train_config(cfg, 2, "/tmp/x", "b")
    assert tc.scaling.num_workers == 2 and tc.scaling.grad_compress == "bf16" and tc.optim.accum_steps == 2
    assert tc.schedule.log_every == 5  # the measured window is the second half

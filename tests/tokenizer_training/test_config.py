from pathlib import Path

import pytest

from tokenflow_ray.tokenizer.training.config import TrainConfig, config_with_overrides, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "tokenizer"


@pytest.mark.parametrize("name", ["tiny", "tokenflow-b", "tokenflow-xl"])
def test_shipped_configs_load(name):
    cfg = load_config(CONFIGS / f"{name}.yaml")
    tok = cfg.tokenizer_config()
    assert cfg.data.image_size % tok.side_multiple == 0
    if name == "tokenflow-b":
        assert (tok.semantic.kind, tok.image_size, tok.grid) == ("clip", 224, 14)
    if name == "tokenflow-xl":
        assert (tok.semantic.kind, tok.image_size, tok.grid) == ("siglip", 384, 27)


@pytest.mark.parametrize("section,values,match", [
    ("optim", {"lr": -1e-4}, "optim.lr must be a positive number"),
    ("optim", {"accum_steps": 0}, "optim.accum_steps must be an integer >= 1"),
    ("model", {"codebook_size": 0}, r"codebook_size \(K\) must be a positive integer"),
    ("model", {"codebook_size": -5}, r"codebook_size \(K\) must be a positive integer"),
    ("model", {"teacher": "dino"}, "unknown teacher 'dino'"),
    ("model", {"preset": "huge"}, "unknown preset 'huge'"),
    ("model", {"teacher": "siglip_384", "teacher_path": "/x"}, "needs a siglip tower"),
    ("model", {"teacher": "clipb_224"}, "needs model.teacher_path"),
    ("scaling", {"num_workers": 0}, "num_workers must be an integer >= 1"),
    ("scaling", {"num_workers": 1.5}, "num_workers must be an integer >= 1"),
    ("scaling", {"cpus_per_worker": 0}, "cpus_per_worker must be > 0"),
    ("scaling", {"placement_strategy": "RANDOM"}, "placement_strategy"),
    ("scaling", {"grad_sync": "allgather"}, "scaling.grad_sync must be one of"),
    ("scaling", {"grad_compress": "fp8"}, "scaling.grad_compress must be one of"),
    ("scaling", {"grad_sync": "ddp", "grad_compress": "bf16"}, "grad_compress=bf16 under DDP needs a GPU"),
    ("data", {"image_size": 18}, "multiple of 4"),
    ("data", {"source": "parquet"}, "needs data.path"),
    ("data", {"batch_size": 0}, "batch_size must be a positive integer"),
    ("schedule", {"checkpoint_every": 0}, "checkpoint_every"),
])
def test_bad_values_fail_at_load(tmp_path, section, values, match):
    import yaml

    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({section: values}))
    with pytest.raises(ValueError, match=match):
        load_config(path)


def test_unknown_keys_and_sections_are_rejected(tmp_path):
    (tmp_path / "a.yaml").write_text("optim: {learning_rate: 1.0}\n")
    with pytest.raises(ValueError, match="unknown keys in optim"):
        load_config(tmp_path / "a.yaml")
    (tmp_path / "b.yaml").write_text("trainer: {}\n")
    with pytest.raises(ValueError, match="unknown config sections"):
        load_config(tmp_path / "b.yaml")


def test_knobs_reach_the_model_config():
    cfg = TrainConfig().replace(model={"codebook_size": 32}, optim={"gan": False, "gan_start_step": 7})
    tok = cfg.tokenizer_config()
    assert tok.quantizer.codebook_size == 32 and tok.loss.gan_weight == 0 and tok.loss.gan_start_step == 7
    cfg = config_with_overrides(cfg, workers=3, storage="/tmp/s", name="n")
    assert (cfg.scaling.num_workers, cfg.run.storage_path, cfg.run.name) == (3, "/tmp/s", "n")


def test_cli_reports_bad_config_before_ray(tmp_path, capsys):
    """The train command fails on a bad value with one line, before Ray (or any worker) starts."""
    import ray

    from tokenflow_ray.tokenizer.train_cli import main

    (tmp_path / "bad.yaml").write_text("optim: {lr: -1}\n")
    was_up = ray.is_initialized()
    assert main(["train", "--config", str(tmp_path / "bad.yaml")]) == 2
    assert "optim.lr must be a positive number" in capsys.readouterr().err
    assert ray.is_initialized() == was_up

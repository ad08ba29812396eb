from pathlib import Path

import pytest
import yaml

from tokenflow_ray.tokenizer.config import leaf_paths, preset
from tokenflow_ray.tokenizer.training.config import TrainConfig, config_with_overrides, load_config, parse_set

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "tokenizer"

# A value different from the tiny preset's for every leaf of the model tree (consistent with each other).
EVERY_MODEL_KNOB = {
    "image_size": 32, "scales": [1, 4], "scale_drop_prob": 0.2,
    "semantic": {"kind": "siglip", "pretrained_path": "/models/siglip", "image_size": 32, "patch_size": 8,
                 "hidden_size": 48, "num_layers": 3, "num_heads": 3, "intermediate_size": 96, "feature_dim": 20,
                 "use_penultimate": True, "code_dim": 16},
    "pixel": {"ch": 8, "ch_mult": [1, 2], "num_res_blocks": 2, "dec_num_res_blocks": 2, "z_channels": 16,
              "code_dim": 4, "attn_at_lowest": False},
    "quantizer": {"codebook_size": 128, "sem_dim": 16, "pix_dim": 4, "w_sem": 0.5, "w_dis": 2.0,
                  "index_mode": "separate", "beta": 0.5, "residual": "var", "search_chunk": 8, "query_chunk": 16,
                  "usage_window": 512},
    "sem_decoder": {"width": 48, "depth": 2, "num_heads": 3},
    "loss": {"sem_weight": 0.5, "vq_weight": 2.0, "mse_weight": 0.5, "l1_weight": 0.1, "lpips_weight": 0.7,
             "lpips_path": "/models/lpips_vgg.pt", "gan_weight": 0.25, "gan_start_step": 5, "disc_ndf": 16,
             "disc_layers": 3},
}


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _leaf(cfg, path: str):
    node = cfg
    for part in path.split("."):
        node = getattr(node, part)
    return list(node) if isinstance(node, tuple) else node


def test_a_yaml_override_reaches_each_model_knob(tmp_path):
    tiny = preset("tiny")
    wanted = _flat(EVERY_MODEL_KNOB)
    assert sorted(wanted) == sorted(leaf_paths(tiny.to_dict()))  # a new knob must be added here (and reachable)
    for path, value in wanted.items():
        assert _leaf(tiny, path) != value, f"{path}: pick a value the preset does not already have"
    (tmp_path / "all.yaml").write_text(yaml.safe_dump({"model": {"preset": "tiny", **EVERY_MODEL_KNOB}}))
    from_yaml = load_config(tmp_path / "all.yaml").model
    for path, value in wanted.items():
        assert _leaf(from_yaml, path) == value, path
    # The CLI's --set reaches the same leaves, over a YAML that names only the preset.
    (tmp_path / "bare.yaml").write_text("model: {preset: tiny}\n")
    from_cli = load_config(tmp_path / "bare.yaml", [f"model.{k}={yaml.safe_dump(v, default_flow_style=True).strip()}"
                                                    for k, v in wanted.items()]).model
    assert from_cli == from_yaml


def test_overridden_knobs_reach_the_built_model(tmp_path):
    from tokenflow_ray.tokenizer.model import DualCodebookTokenizer

    (tmp_path / "c.yaml").write_text("model: {preset: tiny, quantizer: {beta: 0.5}}\n")
    cfg = load_config(tmp_path / "c.yaml", ["model.quantizer.codebook_size=32", "model.scales=[1, 4]"])
    model = DualCodebookTokenizer(cfg.model)
    assert model.quantizer.codebook.embed_sem_KC.shape[0] == 32 and model.quantizer.cfg.beta == 0.5
    assert model.quantizer.scales == (1, 4)


@pytest.mark.parametrize("name", ["tiny", "tokenflow-b", "tokenflow-xl"])
def test_shipped_configs_load(name):
    cfg = load_config(CONFIGS / f"{name}.yaml")
    tok = cfg.model
    if name == "tokenflow-b":
        assert (tok.semantic.kind, tok.image_size, tok.grid) == ("clip", 224, 14)
        assert tok.loss.lpips_path and tok.loss.lpips_weight == 1.0 and tok.loss.gan_start_step == 20000
    if name == "tokenflow-xl":
        assert (tok.semantic.kind, tok.image_size, tok.grid) == ("siglip", 384, 27)
    if name != "tiny":
        assert cfg.data.eval_path and cfg.eval.fid_features


@pytest.mark.parametrize("section,values,match", [
    ("optim", {"lr": -1e-4}, "optim.lr must be a positive number"),
    ("optim", {"accum_steps": 0}, "optim.accum_steps must be an integer >= 1"),
    ("optim", {"gan_start_step": 3}, "unknown keys in optim"),  # one place for it: model.loss.gan_start_step
    ("model", {"quantizer": {"codebook_size": 1}}, "codebook_size must be >= 2"),
    ("model", {"quantizer": {"codebok_size": 8}}, r"unknown key model\.quantizer\.codebok_size"),
    ("model", {"teacher_path": "/x"}, r"unknown key model\.teacher_path"),
    ("model", {"preset": "huge"}, "unknown preset 'huge'"),
    ("model", {"loss": {"lpips_weight": 1.0}}, "model.loss.lpips_path is not set"),
    ("model", {"image_size": 2}, "must be >= the token grid"),
    ("scaling", {"num_workers": 0}, "num_workers must be an integer >= 1"),
    ("scaling", {"num_workers": 1.5}, "num_workers must be an integer >= 1"),
    ("scaling", {"cpus_per_worker": 0}, "cpus_per_worker must be > 0"),
    ("scaling", {"placement_strategy": "RANDOM"}, "placement_strategy"),
    ("scaling", {"grad_sync": "allgather"}, "scaling.grad_sync must be one of"),
    ("scaling", {"grad_compress": "fp8"}, "scaling.grad_compress must be one of"),
    ("scaling", {"grad_sync": "ddp", "grad_compress": "bf16"}, "grad_compress=bf16 under DDP needs a GPU"),
    ("data", {"image_size": 16}, "unknown keys in data"),  # the training side is model.image_size
    ("data", {"source": "parquet"}, "needs data.path"),
    ("data", {"batch_size": 0}, "batch_size must be a positive integer"),
    ("data", {"holdout_fraction": 1.0}, "holdout_fraction"),
    ("eval", {"num_images": 0}, "eval.num_images"),
    ("schedule", {"checkpoint_every": 0}, "checkpoint_every"),
])
def test_bad_values_fail_at_load(tmp_path, section, values, match):
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
    with pytest.raises(ValueError, match="KEY.PATH=VALUE"):
        parse_set(["model.quantizer.codebook_size"])


def test_replace_merges_leaves_and_round_trips():
    cfg = TrainConfig().replace(model={"quantizer": {"codebook_size": 32}, "loss": {"gan_weight": 0.0}})
    assert cfg.model.quantizer.codebook_size == 32 and cfg.model.loss.gan_weight == 0
    assert cfg.model.quantizer.beta == preset("tiny").quantizer.beta  # the rest of the subtree is kept
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    cfg = config_with_overrides(cfg, workers=3, storage="/tmp/s", name="n")
    assert (cfg.scaling.num_workers, cfg.run.storage_path, cfg.run.name) == (3, "/tmp/s", "n")


def test_missing_local_files_fail_on_the_driver(tmp_path):
    cfg = TrainConfig().replace(model={"loss": {"lpips_weight": 1.0, "lpips_path": str(tmp_path / "nope.pt")}})
    with pytest.raises(FileNotFoundError, match="model.loss.lpips_path"):
        cfg.check_local_files()


def test_cli_reports_bad_config_before_ray(tmp_path, capsys):
    """The train command fails on a bad value with one line, before Ray (or any worker) starts."""
    import ray

    from tokenflow_ray.tokenizer.train_cli import main

    (tmp_path / "bad.yaml").write_text("optim: {lr: -1}\n")
    was_up = ray.is_initialized()
    assert main(["train", "--config", str(tmp_path / "bad.yaml")]) == 2
    assert "optim.lr must be a positive number" in capsys.readouterr().err
    assert main(["train", "--config", str(tmp_path / "bad.yaml"), "--set", "model.quantizer.nope=1"]) == 2
    err = capsys.readouterr().err
    assert "unknown key model.quantizer.nope" in err and len(err.strip().splitlines()) == 1
    assert ray.is_initialized() == was_up

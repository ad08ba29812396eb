"""Find a model (local path, hub id, the embedded model or a built-in config) and load its config, weights and
tokenizer; or build it from its config with random weights drawn on the device (`load_format: dummy`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenflow_ray.engine.config import EMBEDDED_MODEL, LOAD_FORMATS, MODEL_PRESETS

DUMMY_STD = 0.02  # the presets' initializer_range (HF's init): a dummy model's activations stay in range

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.txt", "*.jinja"]


def resolve_model_dir(model: str) -> Path:
    if model == EMBEDDED_MODEL:
        from tokenflow_ray.models.embedded import embedded_model_dir

        return embedded_model_dir()
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model: {model!r} has no config.json; expected a Hugging Face model directory")
        return path
    if path.exists():
        raise ValueError(f"model: {model!r} is a file, not a model directory")
    if model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise ValueError(f"model: {model!r} does not exist (expected a local Hugging Face model directory, a hub id "
                         f"of the form org/name, or 'embedded')")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, allow_patterns=_HUB_PATTERNS))
    except Exception as exc:  # offline, unknown repo, gated: all end the same way for the user
        raise ValueError(f"model: {model!r} is not a local directory and could not be fetched from the hub "
                         f"({type(exc).__name__})") from None


def load_hf_config(model_dir: Path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model: architecture {config.model_type!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return config


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def iter_safetensors(model_dir: Path):
    """(name, tensor) over every safetensors shard in the directory."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors weights in {model_dir}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


@dataclass(frozen=True)
class ModelSource:
    """Where a model's parts come from. `weights_dir` None: a built-in config, which has no checkpoint."""

    name: str
    hf_config: Any
    tokenizer_dir: Path
    weights_dir: Path | None


def resolve_model(model: str, load_format: str = "auto") -> ModelSource:
    """A preset name gives its built-in config and the embedded model's tokenizer (dummy weights only); anything
    else is a model directory (local, hub or embedded) whose config and tokenizer are read."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format: expected one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")
    if model in MODEL_PRESETS:
        if load_format != "dummy":
            raise ValueError(f"model: {model!r} is a built-in config with no weights; it loads only with "
                             f"load_format='dummy' (random weights)")
        from tokenflow_ray.models.embedded import embedded_model_dir
        from tokenflow_ray.models.presets import preset_hf_config

        return ModelSource(model, preset_hf_config(model), embedded_model_dir(), None)
    model_dir = resolve_model_dir(model)
    return ModelSource(model, load_hf_config(model_dir), model_dir, model_dir)


def build_model(source: ModelSource, device, dtype, load_format: str = "auto", seed: int = 0):
    """The paged model on `device` in `dtype`: allocated there directly (never materialised elsewhere first), then
    the checkpoint's weights copied in, or (dummy) random weights drawn there."""
    import torch

    from tokenflow_ray.models.llama import LlamaForPagedLM

    with torch.device("meta"):
        model = LlamaForPagedLM(source.hf_config)
    model = model.to(dtype).to_empty(device=device)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    elif source.weights_dir is None:
        raise ValueError(f"model: {source.name!r} has no checkpoint; use load_format='dummy'")
    else:
        model.load_weights(iter_safetensors(source.weights_dir))
    return model.eval().requires_grad_(False)


def init_dummy_weights(model, seed: int, std: float = DUMMY_STD) -> None:
    """HF's init drawn by a seeded generator on the parameters' own device: matrices normal(0, std), norms 1,
    biases 0; a tied lm_head is the embedding. Deterministic per seed and device type."""
    import torch

    device = model.embed.weight.device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # a fixed order: the same seed draws the same weights
            if name.endswith("norm"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, std, generator=gen)
        if getattr(model.config, "tie_word_embeddings", False):
            model.lm_head.weight.copy_(model.embed.weight)

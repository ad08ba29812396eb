"""Find a model directory (local path, hub id, or the embedded model) and load its config, weights, tokenizer."""

from __future__ import annotations

from pathlib import Path

from tokenflow_ray.engine.config import EMBEDDED_MODEL

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

"""Built-in model configs: the HF `config.json` of real models, for `load_format: dummy` (random weights), so a
benchmark of their shape needs no checkpoint (`--model llama3-8b --load-format dummy`).

Values as in each model's published `config.json` (gpu-notes.md §2 gives the shapes and the parameter counts these
configs must reproduce: 8,030,261,248 / 7,615,616,512 / 32,763,876,352; a test counts them on the meta device).
The tokenizer of a preset is the embedded model's byte-level one (a preset has no tokenizer of its own): token ids
are meaningless, step times are real. Prompts are best given as token-id lists (ids < 256 are valid for every
vocabulary here).
"""

from __future__ import annotations

from types import MappingProxyType

from tokenflow_ray.engine.config import MODEL_PRESETS

PRESETS = MappingProxyType({
    # meta-llama/Meta-Llama-3-8B
    "llama3-8b": MappingProxyType({
        "architectures": ("LlamaForCausalLM",), "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "attention_bias": False,
        "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001, "initializer_range": 0.02,
    }),
    # Qwen/Qwen2-7B
    "qwen2-7b": MappingProxyType({
        "architectures": ("Qwen2ForCausalLM",), "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584,
        "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
        "max_position_embeddings": 131072, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "max_window_layers": 28,
        "sliding_window": 131072, "use_sliding_window": False, "tie_word_embeddings": False,
        "bos_token_id": 151643, "eos_token_id": 151643, "initializer_range": 0.02,
    }),
    # Qwen/Qwen2.5-32B
    "qwen2.5-32b": MappingProxyType({
        "architectures": ("Qwen2ForCausalLM",), "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 5120,
        "intermediate_size": 27648, "num_hidden_layers": 64, "num_attention_heads": 40, "num_key_value_heads": 8,
        "max_position_embeddings": 131072, "rope_theta": 1000000.0, "rms_norm_eps": 1e-5, "max_window_layers": 64,
        "sliding_window": 131072, "use_sliding_window": False, "tie_word_embeddings": False,
        "bos_token_id": 151643, "eos_token_id": 151643, "initializer_range": 0.02,
    }),
})
assert tuple(PRESETS) == MODEL_PRESETS, "engine.config.MODEL_PRESETS names the presets defined here"


def preset_hf_config(name: str):
    """The transformers config object of a preset (what `AutoConfig.from_pretrained` gives for its config.json)."""
    if name not in PRESETS:
        raise ValueError(f"model: unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    from transformers import AutoConfig

    spec = dict(PRESETS[name])
    spec["architectures"] = list(spec["architectures"])
    return AutoConfig.for_model(spec.pop("model_type"), **spec)

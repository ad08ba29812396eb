"""The embedded default model: a ~10M-parameter Llama with a byte-level tokenizer, trained on the standard library's
own text (docstrings and pydoc topics: models/embedded_corpus.py) by `models/train_embedded.py`.

The weights ship with the package (weights/embedded-llama-10m.safetensors, bf16 on disk). On first use they are
written once as an ordinary HF model directory (config.json, float32 model.safetensors, tokenizer.json, chat
template) in the cache folder and loaded by the same loader as real checkpoints, so nothing is downloaded and vLLM
or HF can load the very same directory. The folder name carries a hash of the spec and of the weights file:
changing either writes a new model. Tests that compare against HF keep their own tiny random models.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

EMBEDDED_SPEC: dict = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 320,  # 256 bytes + 64 special/reserved tokens
    "hidden_size": 384,
    "intermediate_size": 1024,
    "num_hidden_layers": 6,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,  # GQA, as in Llama-3 and Qwen2
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "pad_token_id": 258,
}
EMBEDDED_WEIGHTS = Path(__file__).parent / "weights" / "embedded-llama-10m.safetensors"
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>",
                  "<|end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def cache_root() -> Path:
    root = os.environ.get("TOKENFLOW_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "tokenflow_ray")
    return Path(root)


def embedded_model_dir(root: Path | None = None) -> Path:
    """The embedded model's directory, written on first use (atomically: concurrent replicas may race)."""
    digest = hashlib.sha256(json.dumps([EMBEDDED_SPEC, weights_digest(), SPECIAL_TOKENS, CHAT_TEMPLATE],
                                       sort_keys=True).encode()).hexdigest()[:10]
    target = (root or cache_root()) / "models" / f"embedded-llama-10m-{digest}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".embedded-", dir=target.parent))
    try:
        write_embedded_model(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race; its copy is identical
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


@functools.cache
def weights_digest(path: Path = EMBEDDED_WEIGHTS) -> str:
    if not path.is_file():
        raise FileNotFoundError(f"model: the embedded model's weights are missing ({path}); reinstall tokenflow_ray")
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def write_embedded_model(path: Path, weights: Path = EMBEDDED_WEIGHTS) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{k: v for k, v in EMBEDDED_SPEC.items() if k not in ("architectures", "model_type")})
    model = LlamaForCausalLM(config).eval()
    state = load_file(str(weights))
    # strict: a checkpoint of another shape or naming fails here, not as garbage text later
    model.load_state_dict({k: v.to(torch.float32) for k, v in state.items()}, strict=True)
    model.generation_config.eos_token_id = EMBEDDED_SPEC["eos_token_id"]
    model.generation_config.pad_token_id = EMBEDDED_SPEC["pad_token_id"]
    model.save_pretrained(path, safe_serialization=True)
    build_byte_tokenizer().save_pretrained(path)


def build_byte_tokenizer():
    """A byte-level BPE tokenizer with no merges: token id = byte value, specials from 256 up."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tokenflow_ray.engine.detokenizer import bytes_to_unicode

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    reserved = [f"<|reserved_{i}|>" for i in range(EMBEDDED_SPEC["vocab_size"] - 256 - len(SPECIAL_TOKENS))]
    backend.add_special_tokens(SPECIAL_TOKENS + reserved)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>", pad_token="<|pad|>",
        model_max_length=EMBEDDED_SPEC["max_position_embeddings"], chat_template=CHAT_TEMPLATE)
    assert len(tokenizer) == EMBEDDED_SPEC["vocab_size"]
    return tokenizer

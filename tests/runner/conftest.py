"""Tiny random HF checkpoints (Llama and Qwen2, with GQA) written once per session, plus the embedded model."""

from __future__ import annotations

import pytest
import torch


def _write_tiny(path, kind: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from tokenflow_ray.models.embedded import build_byte_tokenizer

    common = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, bos_token_id=256, eos_token_id=257,
                  pad_token_id=258)
    torch.manual_seed(7 if kind == "llama" else 11)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True))
    model.save_pretrained(path, safe_serialization=True)
    build_byte_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    return _write_tiny(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    return _write_tiny(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture(scope="session")
def embedded_dir(tmp_path_factory):
    from tokenflow_ray.models.embedded import embedded_model_dir

    return embedded_model_dir(tmp_path_factory.mktemp("cache"))

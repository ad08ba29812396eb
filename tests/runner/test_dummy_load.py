"""`load_format: dummy`: the model built from its config with seeded random weights on the device, no checkpoint
read; the built-in configs (presets) have the published models' shapes."""

from __future__ import annotations

import pytest
import torch

from tokenflow_ray.engine.config import MODEL_PRESETS, CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tokenflow_ray.engine.sampling import SamplingParams
from tokenflow_ray.models import presets
from tokenflow_ray.models.loader import build_model, resolve_model
from tokenflow_ray.runner.factory import build_engine

# gpu-notes.md §2, counted from the HF configs (embedding + untied lm_head + layers + final norm).
PARAMS = {"llama3-8b": 8_030_261_248, "qwen2-7b": 7_615_616_512, "qwen2.5-32b": 32_763_876_352}


def _runner(model, dtype="float32", seed=0, load_format="dummy"):
    engine = build_engine(EngineConfig(
        model=ModelConfig(model=str(model), dtype=dtype, device="cpu", load_format=load_format, seed=seed,
                          fused_cpu_ops=False, cpu_prepack=False, attention_backend="sdpa"),
        cache=CacheConfig(block_size=16, num_device_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)))
    return engine


def _params(engine) -> dict[str, torch.Tensor]:
    return dict(engine.runner.model.named_parameters())


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dummy_weights_have_the_checkpoints_shapes_and_hf_init(fixture, dtype, request):
    model_dir = request.getfixturevalue(fixture)
    real = _params(_runner(model_dir, load_format="auto"))
    engine = _runner(model_dir, dtype=dtype)
    dummy = _params(engine)
    assert engine.runner.model_dir == model_dir  # a directory's config is read, its weights are not
    assert {k: v.shape for k, v in dummy.items()} == {k: v.shape for k, v in real.items()}
    want = getattr(torch, dtype)
    assert all(p.dtype == want and p.device.type == "cpu" for p in dummy.values())
    for name, p in dummy.items():
        if name.endswith("norm"):
            assert torch.equal(p, torch.ones_like(p)), name
        elif name.endswith(".bias"):
            assert torch.equal(p, torch.zeros_like(p)), name
        else:
            assert abs(p.float().std().item() - 0.02) < 0.004, name
            assert abs(p.float().mean().item()) < 0.004, name
            assert not torch.equal(p.float(), real[name].float()), f"{name}: the checkpoint's weights were read"
    tied = engine.runner.model.config.tie_word_embeddings
    assert torch.equal(dummy["lm_head.weight"], dummy["embed.weight"]) == bool(tied)


def test_dummy_weights_are_deterministic_per_seed(tiny_llama_dir):
    a, b, c = (_params(_runner(tiny_llama_dir, seed=s)) for s in (3, 3, 4))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.qkv.weight"], c["layers.0.qkv.weight"])


def test_a_dummy_model_generates_on_cpu(tiny_qwen2_dir):
    engine = _runner(tiny_qwen2_dir)
    vocab = engine.runner.info.vocab_size
    out = engine.generate([[1, 2, 3], list(range(40, 70))], SamplingParams(max_tokens=12, ignore_eos=True))
    assert [len(r.token_ids) for r in out] == [12, 12]
    assert all(0 <= t < vocab for r in out for t in r.token_ids)
    again = _runner(tiny_qwen2_dir).generate([[1, 2, 3], list(range(40, 70))],
                                             SamplingParams(max_tokens=12, ignore_eos=True))
    assert [r.token_ids for r in again] == [r.token_ids for r in out]  # greedy on the same seeded weights


@pytest.mark.parametrize("name", MODEL_PRESETS)
def test_presets_have_the_published_parameter_counts(name):
    from tokenflow_ray.models.llama import LlamaForPagedLM

    source = resolve_model(name, "dummy")
    assert source.weights_dir is None and (source.tokenizer_dir / "tokenizer.json").is_file()
    with torch.device("meta"):  # shapes only: nothing is allocated
        model = LlamaForPagedLM(source.hf_config)
    assert sum(p.numel() for p in model.parameters()) == PARAMS[name]
    c = source.hf_config
    kv_bytes = 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 2
    assert kv_bytes == {"llama3-8b": 131_072, "qwen2-7b": 57_344, "qwen2.5-32b": 262_144}[name]


def test_a_preset_runs_through_the_engine_with_the_embedded_tokenizer(monkeypatch):
    """The preset path end to end (config -> dummy model -> engine with the byte tokenizer), on a preset entry
    shrunk to a tiny shape: a real preset's weights would not fit this box."""
    tiny = dict(presets.PRESETS["llama3-8b"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)
    monkeypatch.setattr(presets, "PRESETS", {**presets.PRESETS, "llama3-8b": tiny})
    engine = _runner("llama3-8b", dtype="bfloat16")
    assert engine.runner.model_dir is None and engine.runner.info.vocab_size == 1000
    assert 128001 in engine.runner.info.eos_token_ids  # the preset's eos, beside the tokenizer's
    out = engine.generate(["hello"], SamplingParams(max_tokens=5, ignore_eos=True))  # text through the tokenizer
    assert len(out[0].token_ids) == 5 and all(0 <= t < 1000 for t in out[0].token_ids)


def test_bad_load_formats_and_presets_without_dummy_give_clear_errors():
    with pytest.raises(ValueError, match="load_format: expected one of auto, dummy"):
        ModelConfig(load_format="random")
    with pytest.raises(ValueError, match="llama3-8b.*load_format='dummy'"):
        ModelConfig(model="llama3-8b")
    with pytest.raises(ValueError, match="built-in config with no weights"):
        resolve_model("qwen2-7b", "auto")
    with pytest.raises(ValueError, match="unknown preset"):
        presets.preset_hf_config("llama3-70b")
    with pytest.raises(ValueError, match="no checkpoint"):
        build_model(resolve_model("llama3-8b", "dummy"), torch.device("meta"), torch.bfloat16, "auto")

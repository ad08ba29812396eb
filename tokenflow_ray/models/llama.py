"""Llama-family decoder (Llama, Mistral, Qwen2) over a flat token batch with paged KV.

Own modules rather than transformers' so that one forward takes every scheduled token of every stream at once
([T, hidden]: decode tokens and prefill chunks together), writes KV straight into the paged pool and fuses QKV and
gate/up projections; the engine benchmark shows the gain. Weights load from the HF checkpoint unchanged in meaning
(see `load_weights`), and greedy outputs match HF `generate` token for token (tests/runner/test_parity.py).

Two forwards compute the same thing: the reference, one torch op per step of HF's arithmetic, and the fused one
(CPU float32 with `layers/csrc/fused_ops.cpp` built): RMSNorm with the residual add, RoPE with the KV write, and
SiLU·mul each one kernel, the residual stream carried in place between layers (as in vLLM).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tokenflow_ray.layers.attention import AttentionBackend, AttentionMetadata


class DecoderLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, eps: float,
                 qkv_bias: bool) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.eps = heads, kv_heads, head_dim, eps
        self.q_size, self.kv_size = heads * head_dim, kv_heads * head_dim
        self.input_norm = nn.Parameter(torch.ones(hidden))
        self.qkv = nn.Linear(hidden, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o = nn.Linear(self.q_size, hidden, bias=False)
        self.post_norm = nn.Parameter(torch.ones(hidden))
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x_TH: torch.Tensor, cos_TD: torch.Tensor, sin_TD: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], attn: AttentionMetadata,
                backend: AttentionBackend) -> torch.Tensor:
        h_TH = F.rms_norm(x_TH, x_TH.shape[-1:], self.input_norm, self.eps)
        qkv = self.qkv(h_TH)
        T = qkv.shape[0]
        qk = _rope(qkv[:, :self.q_size + self.kv_size].view(T, self.heads + self.kv_heads, self.head_dim),
                   cos_TD, sin_TD)
        q_THD, k_THD = qk[:, :self.heads], qk[:, self.heads:]
        v_THD = qkv[:, self.q_size + self.kv_size:].view(T, self.kv_heads, self.head_dim)
        out = backend.forward(q_THD, k_THD, v_THD, kv_cache[0], kv_cache[1], attn)
        x_TH = x_TH + self.o(out)
        h_TH = F.rms_norm(x_TH, x_TH.shape[-1:], self.post_norm, self.eps)
        gate, up = self.gate_up(h_TH).chunk(2, dim=-1)
        return x_TH + self.down(F.silu(gate) * up)

    def forward_fused(self, delta_TH: torch.Tensor, residual_TH: torch.Tensor, positions_T: torch.Tensor,
                      rope_cos: torch.Tensor, rope_sin: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                      attn: AttentionMetadata, backend: AttentionBackend, ops) -> torch.Tensor:
        """residual += delta (the previous layer's MLP output; empty for the first layer), in place; returns this
        layer's MLP output, which the next layer (or the final norm) adds."""
        input_norm, post_norm, qkv_fn, o_fn, gate_up_fn, down_fn = self._fused or self._bind_fused()
        h_TH = ops.add_rms_norm_(delta_TH, residual_TH, input_norm, self.eps)
        qkv = qkv_fn(h_TH)
        T = qkv.shape[0]
        k_cache, v_cache = kv_cache
        ops.rope_write_kv_(qkv, positions_T, rope_cos, rope_sin, k_cache, v_cache, attn.slot_mapping,
                           self.heads, self.kv_heads, self.head_dim)
        q_THD = qkv[:, :self.q_size].view(T, self.heads, self.head_dim)
        k_THD = v_THD = None  # a decode-only step reads its K/V from the pool, where the fused RoPE wrote them
        if attn.prefills:
            k_THD = qkv[:, self.q_size:self.q_size + self.kv_size].view(T, self.kv_heads, self.head_dim)
            v_THD = qkv[:, self.q_size + self.kv_size:].view(T, self.kv_heads, self.head_dim)
        out = backend.forward(q_THD, k_THD, v_THD, k_cache, v_cache, attn)
        h_TH = ops.add_rms_norm_(o_fn(out), residual_TH, post_norm, self.eps)
        return down_fn(ops.silu_mul(gate_up_fn(h_TH)))

    # The fused forward's parameters and the projections' bound forwards (no module-call overhead: no hooks at
    # inference), as plain attributes: module attribute lookups go through nn.Module.__getattr__, 6 a layer a step.
    # Dropped whenever an attribute is set (a projection packed for oneDNN) or the tensors are moved (`_apply`).
    _fused: tuple | None = None

    def _bind_fused(self) -> tuple:
        bound = (self.input_norm, self.post_norm, self.qkv.forward, self.o.forward, self.gate_up.forward,
                 self.down.forward)
        self.__dict__["_fused"] = bound
        return bound

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        self.__dict__["_fused"] = None

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self.__dict__["_fused"] = None
        return out


def _rope(x_TND: torch.Tensor, cos_TD: torch.Tensor, sin_TD: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half rotary embedding, applied to q and k heads together (same arithmetic, half the ops)."""
    half = x_TND.shape[-1] // 2
    rotated = torch.cat((-x_TND[..., half:], x_TND[..., :half]), dim=-1)
    return x_TND * cos_TD[:, None] + rotated * sin_TD[:, None]


class LlamaForPagedLM(nn.Module):
    def __init__(self, hf_config) -> None:
        super().__init__()
        c = hf_config
        self.config = c
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.num_kv_heads = c.num_key_value_heads or c.num_attention_heads
        qkv_bias = c.model_type == "qwen2" or bool(getattr(c, "attention_bias", False))
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(c.hidden_size, c.num_attention_heads, self.num_kv_heads, self.head_dim,
                         c.intermediate_size, c.rms_norm_eps, qkv_bias) for _ in range(c.num_hidden_layers))
        self.norm = nn.Parameter(torch.ones(c.hidden_size))
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.fused_ops = None  # the compiled kernels module when `use_fused_cpu_ops` found it

    def use_fused_cpu_ops(self) -> bool:
        """Switch to the fused forward (CPU float32 only) if its kernels build; returns whether it is on."""
        from tokenflow_ray.layers.cpu_kernels import load_fused_ops

        if self.embed.weight.device.type != "cpu" or self.embed.weight.dtype != torch.float32:
            return False
        self.fused_ops = load_fused_ops()
        return self.fused_ops is not None

    def build_rope_tables(self, max_positions: int, device: torch.device) -> None:
        """cos/sin for every position, computed as HF's rotary embedding does (init function, float32, scaling)."""
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        rope_params = getattr(self.config, "rope_parameters", None) or getattr(self.config, "rope_scaling", None) or {}
        rope_type = rope_params.get("rope_type", rope_params.get("type", "default"))
        if rope_type == "default":
            base = rope_params.get("rope_theta", getattr(self.config, "rope_theta", 10000.0))
            dim = int(self.head_dim * rope_params.get("partial_rotary_factor", 1.0))
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float)
                                       / dim))
            scaling = 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](self.config, device)
        pos = torch.arange(max_positions, device=device, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        dtype = self.embed.weight.dtype
        self.rope_cos = (emb.cos() * scaling).to(dtype)
        self.rope_sin = (emb.sin() * scaling).to(dtype)

    def forward(self, input_ids_T: torch.Tensor, positions_T: torch.Tensor,
                kv_layers: Sequence[tuple[torch.Tensor, torch.Tensor]], attn: AttentionMetadata,
                backend: AttentionBackend) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm. kv_layers: each layer's (K, V) pool views, [blocks,
        block_size, kv_heads, head_dim] each (`KVPool.layers`; strided over blocks in the block-major layout)."""
        x_TH = self.embed(input_ids_T)
        ops = self.fused_ops
        if ops is not None:
            # Written in place by the layers' fused norms (the embedding output is a fresh tensor); the KV of
            # the step is written by the fused RoPE, so the attention backends skip their own write.
            attn.kv_written = True
            delta = x_TH.new_empty(0)
            cos, sin = self.rope_cos, self.rope_sin
            for layer, kv in zip(self.layers, kv_layers):
                delta = layer.forward_fused(delta, x_TH, positions_T, cos, sin, kv, attn, backend, ops)
            return ops.add_rms_norm_(delta, x_TH, self.norm, self.config.rms_norm_eps)
        cos_TD, sin_TD = self.rope_cos[positions_T], self.rope_sin[positions_T]
        for layer, kv in zip(self.layers, kv_layers):
            x_TH = layer(x_TH, cos_TD, sin_TD, kv, attn, backend)
        return F.rms_norm(x_TH, x_TH.shape[-1:], self.norm, self.config.rms_norm_eps)

    def prepack_for_cpu(self, gemm: str = "auto") -> str | None:
        """Swap every linear layer (lm_head too) for one with its weight packed once for a CPU GEMM kernel: about 2x
        faster decode GEMMs than the default path on this project's CPUs (see `packed_linear.py`). fp32 on CPU.
        Returns the kernel (None: none could run here, the layers stay as they are)."""
        from tokenflow_ray.layers.packed_linear import pack_linears, resolve_cpu_gemm

        kernel = resolve_cpu_gemm(gemm)
        if kernel is None:
            return None
        for layer in self.layers:
            pack_linears(layer, ("qkv", "o", "gate_up", "down"), kernel)
        pack_linears(self, ("lm_head",), kernel)
        return kernel

    def compute_logits(self, hidden_SH: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_SH).float()

    # ---- weights ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Map HF names onto fused parameters: q/k/v -> qkv, gate/up -> gate_up. Every parameter must be set."""
        parts: dict[str, torch.Tensor] = {}
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            parts[name] = tensor
        if "lm_head.weight" not in parts:
            if not getattr(self.config, "tie_word_embeddings", False):
                raise ValueError("model: checkpoint has no lm_head.weight and does not tie embeddings")
            parts["lm_head.weight"] = parts["embed_tokens.weight"]
        seen: set[str] = set()

        def take(key: str) -> torch.Tensor:
            if key not in parts:
                raise ValueError(f"model: checkpoint is missing {key}")
            seen.add(key)
            return parts[key]

        self.embed.weight.copy_(take("embed_tokens.weight"))
        self.norm.copy_(take("norm.weight"))
        self.lm_head.weight.copy_(take("lm_head.weight"))
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            layer.input_norm.copy_(take(p + "input_layernorm.weight"))
            layer.post_norm.copy_(take(p + "post_attention_layernorm.weight"))
            layer.qkv.weight.copy_(torch.cat([take(p + f"self_attn.{x}_proj.weight") for x in "qkv"]))
            if layer.qkv.bias is not None:
                layer.qkv.bias.copy_(torch.cat([take(p + f"self_attn.{x}_proj.bias") for x in "qkv"]))
            layer.o.weight.copy_(take(p + "self_attn.o_proj.weight"))
            layer.gate_up.weight.copy_(torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]))
            layer.down.weight.copy_(take(p + "mlp.down_proj.weight"))
        unused = set(parts) - seen - {"embed_tokens.weight"}
        if unused:
            raise ValueError(f"model: checkpoint has weights this architecture does not use: {sorted(unused)[:5]}")

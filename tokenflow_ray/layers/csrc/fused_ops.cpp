// The small per-layer ops of a decoder step, fused on CPU (float32): at decode batch sizes each is a few
// microseconds of arithmetic behind ~5-10 us of dispatch, and the unfused chain reads and writes every activation
// several times. The arithmetic is the reference's, term for term (models/llama.py's unfused path, HF's modules):
//
//   add_rms_norm_(x, residual, w, eps): residual += x (unless x is empty), returns w * (residual * rsqrt(mean(r^2)
//                                        + eps)). The residual stream stays in `residual`, as in vLLM's fused op.
//   silu_mul(gate_up):                  [T, 2I] -> [T, I], silu(gate) * up.
//   rope_write_kv_(qkv, pos, cos, sin, k_cache, v_cache, slots, heads, kv_heads, head_dim): rotate-half RoPE on the
//                                        q and k heads of the fused QKV output in place, and write the rotated k and
//                                        v rows straight into their paged-pool slots (no separate KV-write pass).
//   argmax_rows(logits):                [S, V] -> a list of S ints, each row's first maximum (NaN counts as the
//                                        maximum, as in torch.argmax): a greedy step's tokens without an argmax
//                                        kernel and a .tolist() behind the dispatcher (tens of us after the lm_head).
//
// Built with -ffp-contract=off so that a*b + c*d rounds like the reference's separate multiply and add kernels.
// What these kernels use, not <torch/extension.h> (the whole C++ frontend): a third of the build time.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/utils/pybind.h>
#include <pybind11/stl.h>  // argmax_rows returns a list

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec_exp.h"

namespace {

using namespace tokenflow;

// Rows per parallel task: ATen's own grain (32k elements), so these kernels use threads exactly when torch's
// elementwise ops would. Smaller tasks lose more at OpenMP's barrier than they gain, badly so on a shared box.
inline int64_t grain_rows(int64_t row_len) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(row_len, 1)); }

void check_f32_2d(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, ": float32 only");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, ": expected a 2-d tensor with contiguous rows");
}

}  // namespace

at::Tensor add_rms_norm_(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  check_f32_2d(residual, "residual");
  TORCH_CHECK(residual.is_contiguous(), "residual: must be contiguous (it is updated in place)");
  const bool add = x.numel() > 0;
  if (add) {
    check_f32_2d(x, "x");
    TORCH_CHECK(x.sizes() == residual.sizes(), "x and residual differ in shape");
  }
  const int64_t T = residual.size(0), Hd = residual.size(1);
  TORCH_CHECK(weight.numel() == Hd && weight.is_contiguous() && weight.scalar_type() == at::kFloat, "bad weight");
  auto out = at::empty_like(residual);
  float* rp = residual.data_ptr<float>();
  const float* xp = add ? x.data_ptr<float>() : nullptr;
  const int64_t xs = add ? x.stride(0) : 0;
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, T, grain_rows(Hd), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* r = rp + t * Hd;
      if (add) {
        const float* a = xp + t * xs;
#pragma omp simd
        for (int64_t i = 0; i < Hd; ++i) r[i] += a[i];
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < Hd; ++i) ss += r[i] * r[i];
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(Hd) + feps);
      float* o = op + t * Hd;
#pragma omp simd
      for (int64_t i = 0; i < Hd; ++i) o[i] = wp[i] * (r[i] * inv);
    }
  });
  return out;
}

at::Tensor silu_mul(at::Tensor gate_up) {
  check_f32_2d(gate_up, "gate_up");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) == 2 * I, "gate_up: last dimension must be even");
  auto out = at::empty({T, I}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  const int64_t gs = gate_up.stride(0);
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, grain_rows(2 * I), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = gp + t * gs;
      const float* u = g + I;
      float* o = op + t * I;
      typedef Vec<kNativeLanes>::F V;
      int64_t i = 0;
      for (; i + kNativeLanes <= I; i += kNativeLanes) {  // silu(g) = g / (1 + exp(-g)), as torch's kernel computes it
        const V gv = loadv<V>(g + i);
        storev(o + i, gv / (1.0f + expv<kNativeLanes>(-gv)) * loadv<V>(u + i));
      }
      for (; i < I; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    }
  });
  return out;
}

void rope_write_kv_(at::Tensor qkv, at::Tensor positions, at::Tensor cos, at::Tensor sin,
                    at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_mapping, int64_t heads,
                    int64_t kv_heads, int64_t head_dim) {
  check_f32_2d(qkv, "qkv");
  check_f32_2d(cos, "cos");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && sin.sizes() == cos.sizes(), "bad rope tables");
  TORCH_CHECK(cos.size(1) == head_dim && head_dim % 2 == 0, "rope tables must be [positions, head_dim]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
              k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat, "bad caches");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(2) == kv_heads && k_cache.size(3) == head_dim, "bad cache shape");
  const int64_t T = qkv.size(0), width = (heads + 2 * kv_heads) * head_dim;
  TORCH_CHECK(qkv.size(1) == width, "qkv: width must be (heads + 2 * kv_heads) * head_dim");
  auto pos = positions.to(at::kLong).contiguous();
  auto slots = slot_mapping.to(at::kLong).contiguous();
  TORCH_CHECK(pos.numel() == T && slots.numel() == T, "positions/slot_mapping: one per token");
  const int64_t num_pos = cos.size(0), num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t half = head_dim / 2, row = kv_heads * head_dim, qs = qkv.stride(0);
  float* base = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t* slp = slots.data_ptr<int64_t>();
  at::parallel_for(0, T, grain_rows(width), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t p = pp[t], slot = slp[t];
      TORCH_CHECK(p >= 0 && p < num_pos, "position out of range of the rope tables");
      TORCH_CHECK(slot >= 0 && slot < num_slots, "slot out of range of the KV pool");
      const float* c = cp + p * head_dim;
      const float* s = sp + p * head_dim;
      float* x = base + t * qs;
      // q heads then k heads: x*cos + rotate_half(x)*sin, rotate_half(x) = (-x2, x1).
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        float* v = x + h * head_dim;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = v[i], b = v[i + half];
          v[i] = a * c[i] + (-b) * s[i];
          v[i + half] = b * c[i + half] + a * s[i + half];
        }
      }
      std::memcpy(kc + slot * row, x + heads * head_dim, row * sizeof(float));
      std::memcpy(vc + slot * row, x + (heads + kv_heads) * head_dim, row * sizeof(float));
    }
  });
}

std::vector<int64_t> argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous() &&
              logits.size(1) > 0, "argmax_rows: a contiguous float32 [S, V] tensor with V > 0");
  const int64_t S = logits.size(0), V = logits.size(1);
  const float* p = logits.data_ptr<float>();
  std::vector<int64_t> out(S);
  for (int64_t r = 0; r < S; ++r) {
    const float* row = p + r * V;
    int64_t best = 0;
    float top = row[0];
    for (int64_t j = 1; j < V && !std::isnan(top); ++j)
      if (row[j] > top || std::isnan(row[j])) top = row[best = j];
    out[r] = best;
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x; RMSNorm(residual) * weight (CPU, float32)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up over a fused gate/up output (CPU, float32)");
  m.def("rope_write_kv_", &rope_write_kv_, "rotate-half RoPE on q/k in place and KV written to its slots");
  m.def("argmax_rows", &argmax_rows, "each row's first maximum, as a list (CPU, float32)");
}

// Decode attention over the paged KV pool on CPU: one pass over each stream's blocks, no gather copy.
//
// q [D, H, hd] (one query token per stream), k_cache/v_cache [blocks, block_size, kv_heads, hd] (a layer's pool),
// block_tables [D, W] int64, seq_lens [D] int64 (context length including the new token). The G = H / kv_heads
// query heads of one KV head share each K/V row while it is in cache; softmax is online (running max and sum), so
// each K and V row is read once. Work items are streams, spread over ATen's OpenMP threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <cmath>
#include <limits>
#include <vector>

#include "vec_exp.h"

namespace {

using namespace tokenflow;

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

inline void axpy(float* __restrict y, const float* __restrict x, float a, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

inline float hsum16(v16 v) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

// Scores of one query row against n K rows: 16 lanes of products per chunk, one horizontal sum per row.
template <int C>
inline void scores_v(const float* q, const float* k, int64_t stride, int64_t n, float scale, float* out) {
  v16 qv[C];
  for (int c = 0; c < C; ++c) qv[c] = load16(q + 16 * c);
  for (int64_t t = 0; t < n; ++t) {
    const float* kr = k + t * stride;
    v16 acc = qv[0] * load16(kr);
    for (int c = 1; c < C; ++c) acc += qv[c] * load16(kr + 16 * c);
    out[t] = hsum16(acc) * scale;
  }
}

// acc (hd floats) = acc * correction + sum_t p[t] * V[t], with acc in registers across the n rows.
template <int C>
inline void pv_v(float* acc, float correction, const float* p, const float* v, int64_t stride, int64_t n) {
  v16 a[C];
  for (int c = 0; c < C; ++c) a[c] = load16(acc + 16 * c) * correction;
  for (int64_t t = 0; t < n; ++t) {
    const float* vr = v + t * stride;
    for (int c = 0; c < C; ++c) a[c] += p[t] * load16(vr + 16 * c);
  }
  for (int c = 0; c < C; ++c) store16(acc + 16 * c, a[c]);
}

inline void scale_(float* __restrict y, float a, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] *= a;
}

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
              v_cache.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  q = q.contiguous();
  auto tables = block_tables.to(at::kLong).contiguous();
  auto lens = seq_lens.to(at::kLong).contiguous();
  const int64_t D = q.size(0), H = q.size(1), hd = q.size(2);
  const int64_t bs = k_cache.size(1), kvh = k_cache.size(2), W = tables.size(1);
  TORCH_CHECK(k_cache.size(3) == hd && H % kvh == 0 && tables.size(0) == D && lens.size(0) == D, "bad shapes");
  const int64_t G = H / kvh, block_stride = bs * kvh * hd, tok_stride = kvh * hd;
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  // One work item per stream, all its KV heads together: a token's K (or V) row holds every head, so a block is
  // pulled from memory once and then read from L1 head by head.
  at::parallel_for(0, D, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(H * hd), m(H), l(H), s(H * bs);
    for (int64_t d = begin; d < end; ++d) {
      const int64_t len = lp[d];
      TORCH_CHECK(len > 0 && len <= W * bs, "seq_len out of range for the block table");
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      for (int64_t b = 0, nb = (len + bs - 1) / bs; b < nb; ++b) {
        const int64_t n = std::min(bs, len - b * bs);
        for (int64_t h = 0; h < kvh; ++h) {
          const float* kb = kp + tp[d * W + b] * block_stride + h * hd;
          const float* vb = vp + tp[d * W + b] * block_stride + h * hd;
          for (int64_t g = 0; g < G; ++g) {
            const int64_t qh = h * G + g;  // query head
            const float* qd = qp + (d * H + qh) * hd;
            float* sg = s.data() + qh * bs;
            if (hd == 64) {
              scores_v<4>(qd, kb, tok_stride, n, fscale, sg);
            } else if (hd == 128) {
              scores_v<8>(qd, kb, tok_stride, n, fscale, sg);
            } else {
              for (int64_t t = 0; t < n; ++t) sg[t] = dot(qd, kb + t * tok_stride, hd) * fscale;
            }
            float mb = m[qh];
            for (int64_t t = 0; t < n; ++t) mb = std::max(mb, sg[t]);
            const float correction = std::exp(m[qh] - mb);  // exp(-inf) = 0 on the first block
            l[qh] *= correction;
            m[qh] = mb;
            for (int64_t t = 0; t < n; ++t) sg[t] -= mb;
            exp_inplace(sg, n);  // vectorized: a scalar exp per score cost more than the dot products
            for (int64_t t = 0; t < n; ++t) l[qh] += sg[t];
            float* a = acc.data() + qh * hd;
            if (hd == 64) {
              pv_v<4>(a, correction, sg, vb, tok_stride, n);
            } else if (hd == 128) {
              pv_v<8>(a, correction, sg, vb, tok_stride, n);
            } else {
              scale_(a, correction, hd);
              for (int64_t t = 0; t < n; ++t) axpy(a, vb + t * tok_stride, sg[t], hd);
            }
          }
        }
      }
      for (int64_t qh = 0; qh < H; ++qh) {
        float* o = op + (d * H + qh) * hd;
        const float inv = 1.f / l[qh];
        for (int64_t i = 0; i < hd; ++i) o[i] = acc[qh * hd + i] * inv;
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over paged KV (CPU, float32)");
}

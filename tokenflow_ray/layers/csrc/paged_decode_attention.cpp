// Decode attention over the paged KV pool on CPU: one pass over each stream's blocks, no gather copy.
//
// q [D, H, hd] (one query token per stream), k_cache/v_cache [blocks, block_size, kv_heads, hd] (a layer's pool),
// block_tables [D, W] int64, seq_lens [D] int64 (context length including the new token); or the engine's persistent
// tables [R, W] with each stream's row and position (`paged_decode_attention_rows`).
//
// Work items are streams (in small batches, (stream, KV head) pairs), handed to ATen's threads from a shared counter.
// A KV head's G = H / kv_heads query heads go through the context in groups, L tokens at a time (L = the build's
// vector width, 16 floats with AVX-512 and 8 with AVX2: vec_exp.h): each K row is loaded once for every head of the
// group, the L scores of a head come out of one transpose-and-add tree (not L horizontal sums), the softmax is
// online (running max, lane-wise running sum, one vector exp per head and chunk), and each V row is loaded once and
// added into every head's accumulator, which stay in registers. The next block's rows are prefetched (whole rows on
// the first head's pass): blocks lie wherever the pool put them. head_dim 16/32/64/128 take this path; other sizes a
// scalar one.
// What these kernels use, not <torch/extension.h> (the whole C++ frontend): a third of the build time.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <cmath>
#include <limits>
#include <vector>

#include "vec_exp.h"

namespace {

using namespace tokenflow;

template <int L> using F = typename Vec<L>::F;

template <int... I, class V>
inline V shuf(V a, V b) { return __builtin_shufflevector(a, b, I...); }

template <class V> inline V vmax(V a, V b) { return a > b ? a : b; }

// Lane t of the result is the sum of a[slot<L>(t)]'s lanes: a transpose-and-add tree (L - 1 adds of two-source
// shuffles) instead of L serial horizontal sums, which cost more than the dot products themselves. The 16-lane tree
// returns token t's sum in lane t; the 8-lane one (in-lane shuffles where it can, AVX2 has few across its halves)
// in lane perm(t) = 0 4 2 6 1 5 3 7, so callers store token t's partial sums at a[perm(t)] (perm is its own
// inverse) and read the scores in token order.
inline F<16> reduce_lanes(const F<16>* a) {
  F<16> b[8], c[4], d[2];
  for (int j = 0; j < 8; ++j)
    b[j] = shuf<0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23>(a[2 * j], a[2 * j + 1]) +
           shuf<8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31>(a[2 * j], a[2 * j + 1]);
  for (int j = 0; j < 4; ++j)
    c[j] = shuf<0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27>(b[2 * j], b[2 * j + 1]) +
           shuf<4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31>(b[2 * j], b[2 * j + 1]);
  for (int j = 0; j < 2; ++j)
    d[j] = shuf<0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29>(c[2 * j], c[2 * j + 1]) +
           shuf<2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31>(c[2 * j], c[2 * j + 1]);
  return shuf<0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30>(d[0], d[1]) +
         shuf<1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31>(d[0], d[1]);
}

inline F<8> reduce_lanes(const F<8>* a) {
  F<8> b[4], c[2];
  for (int j = 0; j < 4; ++j)  // [a0 lo + a0 hi | a1 lo + a1 hi]: one cross-half permute each
    b[j] = shuf<0, 1, 2, 3, 8, 9, 10, 11>(a[2 * j], a[2 * j + 1]) +
           shuf<4, 5, 6, 7, 12, 13, 14, 15>(a[2 * j], a[2 * j + 1]);
  for (int j = 0; j < 2; ++j)  // in-lane from here on
    c[j] = shuf<0, 1, 8, 9, 4, 5, 12, 13>(b[2 * j], b[2 * j + 1]) +
           shuf<2, 3, 10, 11, 6, 7, 14, 15>(b[2 * j], b[2 * j + 1]);
  return shuf<0, 8, 2, 10, 4, 12, 6, 14>(c[0], c[1]) + shuf<1, 9, 3, 11, 5, 13, 7, 15>(c[0], c[1]);
}

template <int L> constexpr int slot(int t) { return L == 8 ? ((t & 1) << 2) | (t & 2) | ((t & 4) >> 2) : t; }

inline float hmax(F<16> v) {
  v = vmax(v, shuf<8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7>(v, v));
  v = vmax(v, shuf<4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11>(v, v));
  v = vmax(v, shuf<2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13>(v, v));
  v = vmax(v, shuf<1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14>(v, v));
  return v[0];
}

inline float hmax(F<8> v) {
  v = vmax(v, shuf<4, 5, 6, 7, 0, 1, 2, 3>(v, v));
  v = vmax(v, shuf<2, 3, 0, 1, 6, 7, 4, 5>(v, v));
  v = vmax(v, shuf<1, 0, 3, 2, 5, 4, 7, 6>(v, v));
  return v[0];
}

struct Shape {
  int64_t H, G, kvh, hd, bs, W, block_stride, tok_stride;
};

// GB query heads of one KV head (C = hd / L vectors of L lanes per row) attend over a stream's context, L context
// tokens at a time, with an online softmax (running max, lane-wise running sum): each K and V row is loaded once
// for all GB heads, and the GB heads' independent chains interleave (one head at a time was latency-bound).
// Wide: the group's C x GB accumulators would not fit AVX2's 16 registers (a 64-wide head is 8 of them alone).
// Its chunks loop head by head, and accumulator by accumulator through the chunk's tokens, so a few registers are
// live at a time and the rest wait in L1; every head's arithmetic, and its order, is the narrow loops'. Groups of
// several heads still pass over a stream's blocks once: one head at a time took G passes, and on the kernel alone
// (32 streams of 64-194 tokens, G = 3) a 64-wide layer took 0.12-0.14 ms against 0.08-0.09 now, 0.058 at 16 lanes.
template <int L, int C, int GB>
constexpr bool Wide = L == 8 && C * GB > 8;

template <int L, int C, int GB>
struct GroupState {
  typedef F<L> V;
  V qv[GB][C], acc[GB][C], lsum[GB];
  float m[GB];
};

// One chunk of n <= L context tokens (rows kr0, vr0 strided by tok_stride). Full: n == L, the loops over tokens
// have a compile-time count (unrolled, no masks): every chunk but a block's last partial one.
template <int L, int C, int GB, bool Full>
inline void attend_chunk(GroupState<L, C, GB>& st, const float* kr0, const float* vr0, int64_t tok_stride, int n,
                         float scale) {
  typedef F<L> V;
  if (Full) n = L;
  alignas(64) V a[GB][L];
  alignas(64) float p[GB][L];
  // Rows past the context may lie past the pool (block_size < L): never read them.
  if constexpr (Wide<L, C, GB>) {  // a head at a time over the chunk's rows, which stay in L1 for the next head
    for (int g = 0; g < GB; ++g)
      for (int t = 0; t < n; ++t) {
        const float* kr = kr0 + t * tok_stride;
        V x = st.qv[g][0] * loadv<V>(kr);
        for (int c = 1; c < C; ++c) x += st.qv[g][c] * loadv<V>(kr + c * L);
        a[g][slot<L>(t)] = x;
      }
  } else {
    for (int t = 0; t < n; ++t) {
      V k[C];
      for (int c = 0; c < C; ++c) k[c] = loadv<V>(kr0 + t * tok_stride + c * L);
      for (int g = 0; g < GB; ++g) {
        V x = st.qv[g][0] * k[0];
        for (int c = 1; c < C; ++c) x += st.qv[g][c] * k[c];
        a[g][slot<L>(t)] = x;
      }
    }
  }
  V iota, valid;
  if (!Full) {
    for (int t = n; t < L; ++t)
      for (int g = 0; g < GB; ++g) a[g][slot<L>(t)] = splat<V>(0.f);
    for (int i = 0; i < L; ++i) iota[i] = static_cast<float>(i);
    valid = splat<V>(static_cast<float>(n));
  }
  V sc[GB];
  bool grew = false;
  alignas(64) float shift[L] = {0.f};
  for (int g = 0; g < GB; ++g) {
    sc[g] = reduce_lanes(a[g]) * scale;
    if (!Full) sc[g] = iota < valid ? sc[g] : splat<V>(-std::numeric_limits<float>::infinity());
    const float mb = hmax(sc[g]);
    if (mb > st.m[g]) {
      shift[g] = st.m[g] - mb;  // exp(-inf) = 0 on the first chunk
      st.m[g] = mb;
      grew = true;
    }
  }
  if (grew) {  // rescale only when some head's running max grew: after the first chunks it seldom does
    const V corr = expv<L>(loadv<V>(shift));  // the GB heads' rescale factors in one vector exp
    for (int g = 0; g < GB; ++g) {
      st.lsum[g] *= corr[g];
      for (int c = 0; c < C; ++c) st.acc[g][c] *= corr[g];
    }
  }
  for (int g = 0; g < GB; ++g) {
    V pv = expv<L>(sc[g] - st.m[g]);
    if (!Full) pv = iota < valid ? pv : splat<V>(0.f);
    st.lsum[g] += pv;
    storev(p[g], pv);
  }
  if constexpr (Wide<L, C, GB>) {  // one accumulator at a time through the chunk's tokens, in the same order
    for (int g = 0; g < GB; ++g)
      for (int c = 0; c < C; ++c) {
        V r = st.acc[g][c];
        for (int t = 0; t < n; ++t) r += p[g][t] * loadv<V>(vr0 + t * tok_stride + c * L);
        st.acc[g][c] = r;
      }
  } else {
    for (int t = 0; t < n; ++t) {
      V v[C];
      for (int c = 0; c < C; ++c) v[c] = loadv<V>(vr0 + t * tok_stride + c * L);
      for (int g = 0; g < GB; ++g)
        for (int c = 0; c < C; ++c) st.acc[g][c] += p[g][t] * v[c];
    }
  }
}

template <int L, int C, int GB>
void attend_group(const Shape& s, const float* q, const float* kp, const float* vp, const int64_t* table,
                  int64_t len, int64_t h, float scale, float* out) {
  GroupState<L, C, GB> st;
  for (int g = 0; g < GB; ++g) {
    for (int c = 0; c < C; ++c) {
      st.qv[g][c] = loadv<F<L>>(q + g * s.hd + c * L);
      st.acc[g][c] = splat<F<L>>(0.f);
    }
    st.lsum[g] = splat<F<L>>(0.f);
    st.m[g] = -std::numeric_limits<float>::infinity();
  }
  const int64_t nb = (len + s.bs - 1) / s.bs;
  for (int64_t b = 0; b < nb; ++b) {
    const float* kb = kp + table[b] * s.block_stride + h * s.hd;
    const float* vb = vp + table[b] * s.block_stride + h * s.hd;
    if (b + 1 < nb) {  // the next block's rows (every head's on head 0's pass): blocks lie all over the pool
      const int64_t off = table[b + 1] * s.block_stride + h * s.hd;
      const int64_t rows = std::min(s.bs, len - (b + 1) * s.bs), width = h == 0 ? s.tok_stride : s.hd;
      for (int64_t t = 0; t < rows; ++t)
        for (int64_t x = 0; x < width; x += 16) {  // a cache line a prefetch
          __builtin_prefetch(kp + off + t * s.tok_stride + x);
          __builtin_prefetch(vp + off + t * s.tok_stride + x);
        }
    }
    const int64_t n_block = std::min(s.bs, len - b * s.bs);
    int64_t t0 = 0;
    for (; t0 + L <= n_block; t0 += L)
      attend_chunk<L, C, GB, true>(st, kb + t0 * s.tok_stride, vb + t0 * s.tok_stride, s.tok_stride, L, scale);
    if (t0 < n_block)
      attend_chunk<L, C, GB, false>(st, kb + t0 * s.tok_stride, vb + t0 * s.tok_stride, s.tok_stride,
                                    static_cast<int>(n_block - t0), scale);
  }
  for (int g = 0; g < GB; ++g) {
    float l = 0.f;
    for (int i = 0; i < L; ++i) l += st.lsum[g][i];
    const float inv = 1.f / l;
    for (int c = 0; c < C; ++c) storev(out + g * s.hd + c * L, st.acc[g][c] * inv);
  }
}

// All G query heads of KV head h, in groups of at most GB (GB * C accumulators fit the vector registers).
template <int L, int C, int GB>
void attend(const Shape& s, const float* q, const float* kp, const float* vp, const int64_t* table, int64_t len,
            int64_t h, float scale, float* out) {
  int64_t g = 0;
  for (; g + GB <= s.G; g += GB)
    attend_group<L, C, GB>(s, q + g * s.hd, kp, vp, table, len, h, scale, out + g * s.hd);
  if constexpr (GB > 1) {  // GB 1 leaves no remainder: its groups of 2 and 3 would be built and never run
    switch (s.G - g) {
      case 0: break;
      case 1: attend_group<L, C, 1>(s, q + g * s.hd, kp, vp, table, len, h, scale, out + g * s.hd); break;
      case 2: attend_group<L, C, 2>(s, q + g * s.hd, kp, vp, table, len, h, scale, out + g * s.hd); break;
      default: attend_group<L, C, 3>(s, q + g * s.hd, kp, vp, table, len, h, scale, out + g * s.hd); break;
    }
  }
}

// Any head_dim or group size: scalar loops, the same online softmax one row at a time.
void attend_scalar(const Shape& s, const float* q, const float* kp, const float* vp, const int64_t* table,
                   int64_t len, int64_t h, float scale, float* out) {
  const int64_t G = s.G, hd = s.hd;
  std::vector<float> acc(G * hd, 0.f), l(G, 0.f), m(G, -std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < len; ++t) {
    const int64_t off = table[t / s.bs] * s.block_stride + (t % s.bs) * s.tok_stride + h * hd;
    const float* kr = kp + off;
    const float* vr = vp + off;
    for (int64_t g = 0; g < G; ++g) {
      float dot = 0.f;
      for (int64_t i = 0; i < hd; ++i) dot += q[g * hd + i] * kr[i];
      dot *= scale;
      const float mb = std::max(m[g], dot);
      const float correction = std::exp(m[g] - mb), pt = std::exp(dot - mb);
      m[g] = mb;
      l[g] = l[g] * correction + pt;
      for (int64_t i = 0; i < hd; ++i) acc[g * hd + i] = acc[g * hd + i] * correction + pt * vr[i];
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < hd; ++i) out[g * hd + i] = acc[g * hd + i] / l[g];
}

using AttendFn = void (*)(const Shape&, const float*, const float*, const float*, const int64_t*, int64_t, int64_t,
                         float, float*);
// The vector path's kernel for head_dim `hd` and G query heads per KV head, or the scalar one. Groups are sized so
// the GB x C accumulators (and most of the query rows) fit the vector registers: 32 of them with AVX-512, 16 with
// AVX2. At 8 lanes 64- and 128-wide heads do not fit even one at a time, and take the Wide loops.
template <int L>
AttendFn pick_kernel(int64_t hd, int64_t G);

template <>
AttendFn pick_kernel<16>(int64_t hd, int64_t G) {
  if (hd == 16) return G % 3 == 0 ? attend<16, 1, 3> : attend<16, 1, 4>;
  if (hd == 32) return G % 3 == 0 ? attend<16, 2, 3> : attend<16, 2, 4>;
  if (hd == 64) return G % 3 == 0 ? attend<16, 4, 3> : attend<16, 4, 4>;
  if (hd == 128) return attend<16, 8, 2>;
  return attend_scalar;
}

template <>
AttendFn pick_kernel<8>(int64_t hd, int64_t G) {
  if (hd == 16) return G % 3 == 0 ? attend<8, 2, 3> : attend<8, 2, 4>;
  if (hd == 32) return attend<8, 4, 2>;
  if (hd == 64) return G % 3 == 0 ? attend<8, 8, 3> : attend<8, 8, 4>;
  if (hd == 128) return G % 3 == 0 ? attend<8, 16, 3> : attend<8, 16, 4>;
  return attend_scalar;
}

}  // namespace

namespace {

// D streams: stream d's query heads at qp + d * q_row (head stride hd), its table row at tables + row(d) * W, its
// context length lens[d] (or positions[d] + 1).
at::Tensor run(at::Tensor q, const at::Tensor& k_cache, const at::Tensor& v_cache,
               const at::Tensor& tables, const int64_t* rows, const int64_t* lens, int64_t len_offset,
               double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
              v_cache.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.dim() == 2 && tables.stride(1) == 1, "tables: int64 rows");
  // The model's q is a view into the fused QKV output: rows strided, heads packed. Read it in place.
  if (q.stride(2) != 1 || q.stride(1) != q.size(2)) q = q.contiguous();
  const int64_t D = q.size(0), H = q.size(1), hd = q.size(2), q_row = q.stride(0);
  const int64_t bs = k_cache.size(1), kvh = k_cache.size(2), W = tables.size(1), R = tables.size(0);
  TORCH_CHECK(k_cache.size(3) == hd && H % kvh == 0, "bad shapes");
  const Shape s{H, H / kvh, kvh, hd, bs, W, bs * kvh * hd, kvh * hd};
  auto out = at::empty({D, H, hd}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t t_row = tables.stride(0);
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  for (int64_t d = 0; d < D; ++d) {
    TORCH_CHECK(rows == nullptr || (rows[d] >= 0 && rows[d] < R), "row out of range for the block tables");
    const int64_t len = lens[d] + len_offset;
    TORCH_CHECK(len > 0 && len <= W * bs, "seq_len out of range for the block table");
  }
  auto fn = pick_kernel<kNativeLanes>(hd, s.G);
  // Work items are streams, each worker taking a stream's KV heads one after the other: the first head's pass
  // prefetches whole rows (every head's part), so the next heads read them from cache. Items of one (stream, head)
  // each had the two threads read the halves of the same rows apart, and a batch of 32 at 256 tokens took 1.9 ms
  // over 6 layers here against 1.5. With fewer streams than twice the threads, (stream, head) items keep every
  // thread busy. Items go out one at a time from a shared counter: streams of mixed lengths still split evenly.
  const int64_t threads = at::get_num_threads();
  const int64_t heads_per_item = D >= 2 * threads ? kvh : 1;
  const int64_t items = D * kvh / heads_per_item;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(threads, items);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
      const int64_t first = i * heads_per_item, d = first / kvh;
      const int64_t row = rows == nullptr ? d : rows[d];
      for (int64_t h = first % kvh; h < first % kvh + heads_per_item; ++h)
        fn(s, qp + d * q_row + h * s.G * hd, kp, vp, tp + row * t_row, lens[d] + len_offset, h, fscale,
           op + (d * H + h * s.G) * hd);
    }
  });
  return out;
}

}  // namespace

// block_tables [D, W] (one row per stream, gathered), seq_lens [D].
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_tables, at::Tensor seq_lens, double scale) {
  auto tables = block_tables.to(at::kLong).contiguous();
  auto lens = seq_lens.to(at::kLong).contiguous();
  TORCH_CHECK(tables.size(0) == q.size(0) && lens.size(0) == q.size(0), "bad shapes");
  return run(q, k_cache, v_cache, tables, nullptr, lens.data_ptr<int64_t>(), 0, scale);
}

// The persistent tables [R, W] read in place: stream d's row is rows[d], its context positions[d] + 1 tokens
// (the engine's step metadata as it is: no gathered table, no lengths tensor, no dtype conversions per layer).
at::Tensor paged_decode_attention_rows(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                       at::Tensor tables, at::Tensor rows, at::Tensor positions,
                                       double scale) {
  TORCH_CHECK(rows.scalar_type() == at::kLong && positions.scalar_type() == at::kLong, "rows, positions: int64");
  TORCH_CHECK(rows.dim() == 1 && positions.dim() == 1 && rows.stride(0) == 1 && positions.stride(0) == 1 &&
              rows.size(0) == q.size(0) && positions.size(0) == q.size(0), "rows, positions: [D], contiguous");
  return run(q, k_cache, v_cache, tables, rows.data_ptr<int64_t>(), positions.data_ptr<int64_t>(), 1, scale);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over paged KV (CPU, float32)");
  m.def("paged_decode_attention_rows", &paged_decode_attention_rows,
        "the same, reading the persistent block tables by row and the lengths from positions");
  m.def("lanes", [] { return kNativeLanes; }, "floats per vector in this build (16: AVX-512, 8: AVX2)");
}

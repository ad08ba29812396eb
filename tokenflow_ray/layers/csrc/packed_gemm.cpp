// A linear layer's product on CPU (float32), y = x W^T + b, over a weight packed once into column panels.
//
// Why not oneDNN, which the engine used before: its packed linear (`torch.ops.mkldnn._linear_pointwise`) costs
// 11-12 us a call before any arithmetic (a 32x384x16 product takes that long), and a decode step makes 25 calls; and
// at decode batch sizes its kernel waits on weights streamed from DRAM (a model's 24 projections at 32 rows ran at
// 285-320 GFLOP/s cycling through all their weights, 380 in cache). This one is a plain register-blocked loop:
//
//   pack(w [N, K]) -> [ceil(N/P), K, P]: P = NV vectors of columns (4 x 16 = 64 floats with AVX-512, 2 x 8 = 16
//   with AVX2), zero-padded past N, so a panel's row for one k is P contiguous floats.
//   linear(x [M, K], panels, N, bias?) -> y [M, N]: threads take panels (ATen's parallel_for over them); for each
//   chunk of KC k-rows of a panel (32 KB at AVX-512 width: it stays in L1 while every row block reads it), rows go
//   R at a time with R x NV accumulators in registers. While the first row block walks a chunk it prefetches the
//   next chunk into L2: the weights are read from memory once, in order, and the prefetch runs ahead of the
//   hardware's, which stops at each 4 KB page.
//
// Each output is one sequential fused multiply-add chain over k from 0 (stored and reloaded between chunks, exactly),
// then the bias: the same value whatever M, the thread count or the chunking.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>  // pack()'s zero-padded panels
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "vec_exp.h"

namespace {

using namespace tokenflow;

constexpr int L = kNativeLanes;
// Rows a block (R) and vectors a panel row (NV): R x NV accumulators, NV weights and a broadcast fit the registers.
// AVX-512 (32 registers): 4 x 4. AVX2 (16): 6 x 2, BLIS's Haswell shape; its 4 x 2 before took 1.2x as long as oneDNN
// at 32 rows and 8 accumulators did not cover the FMA latency. Measured on the model's 24 projections with the
// kernels built for x86-64-v3 and oneDNN capped at AVX2: 3.1 ms at 32 rows against oneDNN's 3.7 and 4 x 2's 3.7.
constexpr int NV = L == 16 ? 4 : 2;
constexpr int P = L * NV;      // panel width in floats
constexpr int64_t KC = 128;    // k-rows a chunk: 128 x 64 floats = 32 KB at AVX-512 width, 8 KB at AVX2's
constexpr int RMAX = L == 16 ? 4 : 6;
typedef Vec<L>::F V;

// R rows of y's P columns [ncols valid] += x's R rows [k0, k0 + kn) times the chunk's weights (first: from zero).
template <int R>
inline void block(const float* x, int64_t ldx, const float* w, int64_t kn, float* y, int64_t ldy, int64_t ncols,
                  bool first, const float* bias, const float* prefetch) {
  V acc[R][NV];
  // The partial panel's scratch rows live in their own branches: an array at function scope had the accumulators
  // spilled (a model's projections at 32 rows took 2.3 ms instead of 1.6).
  if (first) {
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NV; ++j) acc[r][j] = splat<V>(0.f);
  } else if (ncols == P) {
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NV; ++j) acc[r][j] = loadv<V>(y + r * ldy + j * L);
  } else {  // the last panel's columns past N are not y's
    for (int r = 0; r < R; ++r) {
      float row[P] = {};
      std::memcpy(row, y + r * ldy, ncols * sizeof(float));
      for (int j = 0; j < NV; ++j) acc[r][j] = loadv<V>(row + j * L);
    }
  }
  for (int64_t k = 0; k < kn; ++k) {
    V wv[NV];
    for (int j = 0; j < NV; ++j) wv[j] = loadv<V>(w + k * P + j * L);
    if (prefetch != nullptr)
      for (int c = 0; c < P; c += 16) __builtin_prefetch(prefetch + k * P + c, 0, 2);  // a cache line each
    for (int r = 0; r < R; ++r) {
      const V a = splat<V>(x[r * ldx + k]);
      for (int j = 0; j < NV; ++j) acc[r][j] += a * wv[j];
    }
  }
  if (bias != nullptr) {  // the last chunk's: N floats, so the last panel's part goes through a scratch row
    V bv[NV];
    if (ncols == P) {
      for (int j = 0; j < NV; ++j) bv[j] = loadv<V>(bias + j * L);
    } else {
      float row[P] = {};
      std::memcpy(row, bias, ncols * sizeof(float));
      for (int j = 0; j < NV; ++j) bv[j] = loadv<V>(row + j * L);
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NV; ++j) acc[r][j] += bv[j];
  }
  if (ncols == P) {
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NV; ++j) storev(y + r * ldy + j * L, acc[r][j]);
  } else {
    for (int r = 0; r < R; ++r) {
      float row[P];
      for (int j = 0; j < NV; ++j) storev(row + j * L, acc[r][j]);
      std::memcpy(y + r * ldy, row, ncols * sizeof(float));
    }
  }
}

template <int R>
inline void tail_rows(int64_t rows, const float* x, int64_t ldx, const float* w, int64_t kn, float* y, int64_t ldy,
                      int64_t ncols, bool first, const float* bias, const float* prefetch) {
  if constexpr (R > 0) {
    if (rows == R) return block<R>(x, ldx, w, kn, y, ldy, ncols, first, bias, prefetch);
    tail_rows<R - 1>(rows, x, ldx, w, kn, y, ldy, ncols, first, bias, prefetch);
  }
}

}  // namespace

at::Tensor pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.device().is_cpu(), "pack: w [N, K] float32 CPU");
  const auto wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1), NB = (N + P - 1) / P;
  auto out = at::zeros({NB, K, P}, wc.options());
  const float* src = wc.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb)
      for (int64_t j = 0; j < P && nb * P + j < N; ++j)
        for (int64_t k = 0; k < K; ++k) dst[(nb * K + k) * P + j] = src[(nb * P + j) * K + k];
  });
  return out;
}

at::Tensor linear(const at::Tensor& x_in, const at::Tensor& panels, int64_t N, const c10::optional<at::Tensor>& b) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.device().is_cpu() && x_in.dim() >= 1, "x: float32 CPU");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == P && panels.size(0) == (N + P - 1) / P &&
              panels.scalar_type() == at::kFloat && panels.is_contiguous(), "panels: from pack() of this build");
  const int64_t K = panels.size(1), NB = panels.size(0);
  TORCH_CHECK(x_in.size(-1) == K, "x: last dimension ", x_in.size(-1), " against the weight's ", K);
  const auto x = x_in.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  auto out_sizes = x_in.sizes().vec();
  out_sizes.back() = N;
  auto y = at::empty(out_sizes, x.options());
  at::Tensor bias_c;
  const float* bias = nullptr;
  if (b.has_value() && b->defined()) {
    TORCH_CHECK(b->numel() == N && b->scalar_type() == at::kFloat, "bias: [N] float32");
    bias_c = b->contiguous();  // a no-op for the layer's own bias: nothing allocated per call
    bias = bias_c.data_ptr<float>();
  }
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    const float* mine_end = wp + b1 * K * P;  // this thread's panels are contiguous: prefetch within them
    for (int64_t nb = b0; nb < b1; ++nb) {
      const int64_t ncols = std::min<int64_t>(P, N - nb * P);
      for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kn = std::min(KC, K - k0);
        const float* chunk = wp + (nb * K + k0) * P;
        const float* next = chunk + kn * P;
        const float* prefetch = next + kn * P <= mine_end ? next : nullptr;
        const bool first = k0 == 0;
        const float* bb = bias != nullptr && k0 + kn == K ? bias + nb * P : nullptr;
        int64_t m = 0;
        for (; m + RMAX <= M; m += RMAX)
          block<RMAX>(xp + m * K + k0, K, chunk, kn, yp + m * N + nb * P, N, ncols, first, bb,
                      m == 0 ? prefetch : nullptr);
        if (m < M)
          tail_rows<RMAX - 1>(M - m, xp + m * K + k0, K, chunk, kn, yp + m * N + nb * P, N, ncols, first, bb,
                              m == 0 ? prefetch : nullptr);
      }
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "a linear weight [N, K] in column panels for `linear` (CPU, float32)");
  m.def("linear", &linear, "x W^T + b over packed panels (CPU, float32)", pybind11::arg("x"), pybind11::arg("panels"),
        pybind11::arg("n"), pybind11::arg("bias") = pybind11::none());
  m.def("panel_width", [] { return P; }, "floats a panel row (64: AVX-512, 16: AVX2)");
  m.def("lanes", [] { return kNativeLanes; }, "floats per vector in this build (16: AVX-512, 8: AVX2)");
}

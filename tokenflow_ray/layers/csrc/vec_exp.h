// SIMD vectors for the CPU kernels (GCC/Clang vector extensions) and exp(x) over them. The kernels' native width
// follows the build's -march=native: 16 floats where the CPU has AVX-512, 8 otherwise (AVX2). A 16-float vector
// on an AVX2 build is split in two halves, which is fine for lane-wise arithmetic but not for the attention
// kernel: its cross-lane shuffles of a 64-byte vector compile to long sequences there, and twice the registers
// per vector spill its accumulators (a batch-32 decode step's attention 10x slower than at 8 lanes).
//
// exp: a plain loop with std::floor does not vectorize without -ffast-math (GCC 12 leaves it scalar), and a
// scalar libm call per element costs more than the arithmetic around it. Cephes' expf: range reduction by ln 2
// and a degree-5 polynomial, about 1 ulp over [-87, 88].
#pragma once

#include <cstdint>
#include <cstring>

namespace tokenflow {

template <int L> struct Vec;
template <> struct Vec<8> {
  typedef float F __attribute__((vector_size(32)));
  typedef int32_t I __attribute__((vector_size(32)));
};
template <> struct Vec<16> {
  typedef float F __attribute__((vector_size(64)));
  typedef int32_t I __attribute__((vector_size(64)));
};

// TOKENFLOW_LANES=8|16 overrides the choice (the tests build the other width too, so both paths run on any CPU).
#if defined(TOKENFLOW_LANES)
constexpr int kNativeLanes = TOKENFLOW_LANES;
#elif defined(__AVX512F__)
constexpr int kNativeLanes = 16;
#else
constexpr int kNativeLanes = 8;
#endif
static_assert(kNativeLanes == 8 || kNativeLanes == 16, "TOKENFLOW_LANES: 8 or 16");

template <class V> inline V splat(float a) { return V{} + a; }

template <class V> inline V loadv(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
template <class V> inline void storev(float* p, V v) { std::memcpy(p, &v, sizeof(v)); }

template <int L> inline typename Vec<L>::F expv(typename Vec<L>::F x) {
  typedef typename Vec<L>::F V;
  typedef typename Vec<L>::I VI;
  x = x < -87.0f ? splat<V>(-87.0f) : x;
  x = x > 88.0f ? splat<V>(88.0f) : x;
  const V fx = x * 1.44269504088896341f + 0.5f;
  VI ki = __builtin_convertvector(fx, VI);  // truncates toward zero
  ki += (__builtin_convertvector(ki, V) > fx);  // -1 where that rounded up: floor
  const V k = __builtin_convertvector(ki, V);
  const V r = x - k * 0.693359375f + k * 2.12194440e-4f;
  V p = splat<V>(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const VI bits = (ki + 127) << 23;
  return p * reinterpret_cast<const V&>(bits);
}

}  // namespace tokenflow

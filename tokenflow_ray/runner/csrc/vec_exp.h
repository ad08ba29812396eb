// exp(x) over 16 floats at a time, for the CPU kernels. GCC/Clang vector extensions: AVX-512 with -march=native
// where the CPU has it, narrower SIMD otherwise. A plain loop with std::floor does not vectorize without
// -ffast-math (GCC 12 leaves it scalar), and a scalar libm call per element costs more than the arithmetic around it.
// Cephes' expf: range reduction by ln 2 and a degree-5 polynomial, about 1 ulp over [-87, 88].
#pragma once

#include <cstdint>
#include <cstring>

namespace tokenflow {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));

inline v16 splat(float a) { return v16{} + a; }

inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }

inline v16 exp16(v16 x) {
  x = x < -87.0f ? splat(-87.0f) : x;
  x = x > 88.0f ? splat(88.0f) : x;
  const v16 fx = x * 1.44269504088896341f + 0.5f;
  vi16 ki = __builtin_convertvector(fx, vi16);  // truncates toward zero
  ki += (__builtin_convertvector(ki, v16) > fx);  // -1 where that rounded up: floor
  const v16 k = __builtin_convertvector(ki, v16);
  const v16 r = x - k * 0.693359375f + k * 2.12194440e-4f;
  v16 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vi16 bits = (ki + 127) << 23;
  return p * reinterpret_cast<const v16&>(bits);
}

}  // namespace tokenflow

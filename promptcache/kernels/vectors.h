// 16-lane float32 vectors for promptcache's C++ kernels (attention.cpp, rms_norm.cpp, fused.cpp):
// GCC/Clang vector extensions, lowered to AVX-512, AVX2 or SSE by -march; loads and stores of
// float32 and of bfloat16 bits (uint16_t), widened exactly (the 16 bits moved to a float's upper
// half) and narrowed by rounding to nearest even as torch's conversion does (AVX-512 BF16's
// instruction where the CPU has it, which also flushes subnormals to zero; a NaN stays a NaN);
// a vector exp for x <= 0.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace promptcache_vectors {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));
typedef uint32_t u16v __attribute__((vector_size(64)));
typedef uint16_t h16 __attribute__((vector_size(32)));

inline v16 splat(float x) { return v16{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
inline v16 load(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }
inline v16 load(const uint16_t* p) {
  h16 h;
  std::memcpy(&h, p, sizeof h);
  const u16v w = __builtin_convertvector(h, u16v) << 16;
  v16 v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}
inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) {
  const uint32_t w = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &w, sizeof f);
  return f;
}

#if defined(__AVX512BF16__)
inline void store(uint16_t* p, v16 v) {  // rounded to nearest even (vcvtneps2bf16)
  __m512 f;
  std::memcpy(&f, &v, sizeof f);
  const __m256bh h = _mm512_cvtneps_pbh(f);
  std::memcpy(p, &h, sizeof h);
}
#else
inline void store(uint16_t* p, v16 v) {  // rounded to nearest even; a NaN stays a NaN
  u16v u;
  std::memcpy(&u, &v, sizeof u);
  const u16v rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const i16 nan = v != v;
  const u16v bits = (u16v)((i16)rounded & ~nan) | (u16v)((i16)((u >> 16) | 0x40u) & nan);
  const h16 h = __builtin_convertvector(bits, h16);
  std::memcpy(p, &h, sizeof h);
}
#endif
inline uint16_t round_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if (std::isnan(x)) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
inline void put(float* p, float x) { *p = x; }
inline void put(uint16_t* p, float x) { *p = round_bf16(x); }
// v as the element type of `like` holds it (float32 as is; bfloat16 rounded to it and widened back)
inline float as_stored(float x, const float*) { return x; }
inline float as_stored(float x, const uint16_t*) { return to_float(round_bf16(x)); }
inline v16 as_stored(v16 v, const float*) { return v; }
inline v16 as_stored(v16 v, const uint16_t*) {
  alignas(64) uint16_t tmp[16];
  store(tmp, v);
  return load(tmp);
}

// exp(x) for x <= 0 (attention: scores minus their running max), 0 below -87 (and at -inf):
// Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2, Cephes' degree-6 polynomial, 2^n from the
// exponent bits. Relative error ~1e-7.
inline v16 vexp(v16 x) {
  const i16 live = x > splat(-87.0f);
  x = x > splat(-87.0f) ? x : splat(-87.0f);
  const v16 magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  v16 n = (x * splat(1.44269504088896341f) + magic) - magic;
  v16 r = x - n * splat(0.693359375f) - n * splat(-2.12194440e-4f);
  v16 p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * r * r + r + splat(1.0f);
  const i16 bits = (__builtin_convertvector(n, i16) + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  const i16 out = (i16)(p * scale) & live;
  v16 res;
  std::memcpy(&res, &out, sizeof res);
  return res;
}

}  // namespace promptcache_vectors

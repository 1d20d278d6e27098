// 16-lane float32 vectors for promptcache's C++ kernels (attention.cpp, rms_norm.cpp): GCC/Clang
// vector extensions, lowered to AVX-512, AVX2 or SSE by -march; loads and stores of float32 and
// of bfloat16 bits (uint16_t), widened exactly (the 16 bits moved to a float's upper half).
#pragma once

#include <cstdint>
#include <cstring>

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

}  // namespace promptcache_vectors

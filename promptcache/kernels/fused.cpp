// Two elementwise passes of Llama-form layers in one pass each (CPU), registered as
// torch.ops.promptcache_fused:
//
//   silu_mul(gate, up) -> out      out = silu(gate) * up, a gated MLP's activation
//     gate, up [..., I] float32 or bfloat16, the same shape and dtype, each with its last dimension
//     contiguous and its rows evenly strided (slices of a packed gate/up product are);
//     out [..., I] contiguous.
//   rotary(q, k, cos, sin) -> (q', k')   rotary position embedding, transformers' Llama form
//     q [B, Hq, N, D], k [B, Hk, N, D] (any strides, last dimension contiguous: views of a packed
//     q/k/v product are), cos, sin [B or 1, N, D] of q's dtype; D even;
//     x' = x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[D/2:], x[:D/2]);
//     q', k' as [B, N, H, D] memory viewed [B, H, N, D] (the layout the stock ops give).
//
// Why: the stock code runs these as separate ops, each a pass over the activations (silu, then a
// product; rotary: two products, a negation, a concatenation and a sum per tensor), and in bfloat16
// each with its own conversions: together ~11% of a SmolLM2 RAG batch's CPU time on the 2-core EPYC
// promptcache is measured on.
//
// Rounding follows the stock ops: float32 computes in float32 (sigmoid through the exp of
// vectors.h: agrees with torch's to a few ulps); bfloat16 computes each stock op in float32 and
// rounds its result to bfloat16 where the stock op's bfloat16 output would be rounded (silu, then
// the product; each rotary product, then their sum), so the result is the stock one except where
// the exp's last bits cross a rounding boundary.
//
// Portable C++ (GCC/Clang vector extensions, lowered by -march); threads from ATen's parallel_for.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

#include "vectors.h"

namespace {

using namespace promptcache_vectors;

// silu(x) = x * sigmoid(x); sigmoid through e = exp(-|x|) (never overflows): 1 / (1 + e) for
// x >= 0, e / (1 + e) below
inline v16 vsilu(v16 x) {
  const v16 ax = x < splat(0.0f) ? -x : x;
  const v16 e = vexp(-ax);
  const v16 sig = (x < splat(0.0f) ? e : splat(1.0f)) / (splat(1.0f) + e);
  return x * sig;
}
inline float silu(float x) {
  const float e = std::exp(-std::fabs(x));
  return x * ((x < 0.0f ? e : 1.0f) / (1.0f + e));
}

template <class T>
void silu_mul_rows(const T* g, const T* u, T* out, int64_t n, int64_t width, int64_t gs, int64_t us) {
  at::parallel_for(0, n, 8, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* gr = g + r * gs;
      const T* ur = u + r * us;
      T* o = out + r * width;
      int64_t i = 0;
      for (; i + 16 <= width; i += 16) store(o + i, as_stored(vsilu(load(gr + i)), gr) * load(ur + i));
      for (; i < width; ++i) put(o + i, as_stored(silu(to_float(gr[i])), gr) * to_float(ur[i]));
    }
  });
}

// rows [2-D view: row stride], checked and made evenly strided where they are not
at::Tensor as_rows(const at::Tensor& x) {
  at::Tensor v = x.dim() == 1 ? x.unsqueeze(0) : x.flatten(0, -2);  // a view where the strides allow
  return v.stride(-1) == 1 ? v : v.contiguous();
}

at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  const char* name = "promptcache_fused.silu_mul";
  TORCH_CHECK(gate.device().is_cpu() && up.device().is_cpu(), name, ": CPU tensors only");
  TORCH_CHECK(gate.scalar_type() == up.scalar_type() &&
                  (gate.scalar_type() == at::kFloat || gate.scalar_type() == at::kBFloat16),
              name, ": gate and up must be both float32 or both bfloat16, got ", gate.scalar_type(), " and ",
              up.scalar_type());
  TORCH_CHECK(gate.sizes() == up.sizes() && gate.dim() >= 1, name, ": gate ", gate.sizes(), " and up ", up.sizes(),
              " differ");
  at::Tensor out = at::empty(gate.sizes(), gate.options());
  if (gate.numel() == 0) return out;
  const at::Tensor g = as_rows(gate), u = as_rows(up);
  const int64_t n = g.size(0), width = g.size(1);
  if (gate.scalar_type() == at::kFloat)
    silu_mul_rows<float>(g.data_ptr<float>(), u.data_ptr<float>(), out.data_ptr<float>(), n, width, g.stride(0),
                         u.stride(0));
  else
    silu_mul_rows<uint16_t>(reinterpret_cast<const uint16_t*>(g.data_ptr<at::BFloat16>()),
                            reinterpret_cast<const uint16_t*>(u.data_ptr<at::BFloat16>()),
                            reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), n, width, g.stride(0),
                            u.stride(0));
  return out;
}

// one head's row: out = x * c + rotate_half(x) * s, the products and the sum each as the stock op rounds
template <class T>
inline void rotate_row(const T* x, const T* c, const T* s, T* o, int64_t half) {
  int64_t i = 0;
  for (; i + 16 <= half; i += 16) {
    const v16 x1 = load(x + i), x2 = load(x + half + i);
    const v16 lo = as_stored(x1 * load(c + i), x) - as_stored(x2 * load(s + i), x);
    const v16 hi = as_stored(x2 * load(c + half + i), x) + as_stored(x1 * load(s + half + i), x);
    store(o + i, lo);
    store(o + half + i, hi);
  }
  for (; i < half; ++i) {
    const float x1 = to_float(x[i]), x2 = to_float(x[half + i]);
    put(o + i, as_stored(x1 * to_float(c[i]), x) - as_stored(x2 * to_float(s[i]), x));
    put(o + half + i, as_stored(x2 * to_float(c[half + i]), x) + as_stored(x1 * to_float(s[half + i]), x));
  }
}

template <class T>
void rotary_heads(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  const int64_t B = x.size(0), H = x.size(1), N = x.size(2), D = x.size(3);
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  const T* cp = reinterpret_cast<const T*>(cos.data_ptr());
  const T* sp = reinterpret_cast<const T*>(sin.data_ptr());
  T* op = reinterpret_cast<T*>(out.data_ptr());
  const int64_t cb = cos.size(0) == 1 ? 0 : cos.stride(0), sb = sin.size(0) == 1 ? 0 : sin.stride(0);
  at::parallel_for(0, B * N, 16, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      const int64_t b = t / N, n = t % N;
      const T* c = cp + b * cb + n * cos.stride(1);
      const T* s = sp + b * sb + n * sin.stride(1);
      for (int64_t h = 0; h < H; ++h)
        rotate_row(xp + b * x.stride(0) + h * x.stride(1) + n * x.stride(2), c, s, op + (t * H + h) * D, D / 2);
    }
  });
}

at::Tensor rotate(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin) {
  const at::Tensor x = x_in.stride(3) == 1 ? x_in : x_in.contiguous();
  // [B, N, H, D] memory, returned as [B, H, N, D]
  at::Tensor out = at::empty({x.size(0), x.size(2), x.size(1), x.size(3)}, x.options());
  if (x.numel() != 0) {
    if (x.scalar_type() == at::kFloat)
      rotary_heads<float>(x, cos, sin, out);
    else
      rotary_heads<uint16_t>(x, cos, sin, out);
  }
  return out.transpose(1, 2);
}

std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos_in,
                                          const at::Tensor& sin_in) {
  const char* name = "promptcache_fused.rotary";
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && cos_in.device().is_cpu() && sin_in.device().is_cpu(),
              name, ": CPU tensors only");
  const auto dt = q.scalar_type();
  TORCH_CHECK((dt == at::kFloat || dt == at::kBFloat16) && k.scalar_type() == dt && cos_in.scalar_type() == dt &&
                  sin_in.scalar_type() == dt,
              name, ": q, k, cos and sin must share one dtype, float32 or bfloat16; got ", dt, ", ", k.scalar_type(),
              ", ", cos_in.scalar_type(), ", ", sin_in.scalar_type());
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && cos_in.dim() == 3 && cos_in.sizes() == sin_in.sizes(), name,
              ": q [B, H, N, D], k [B, H, N, D] and cos, sin [B, N, D] expected, got ", q.sizes(), ", ", k.sizes(),
              ", ", cos_in.sizes(), ", ", sin_in.sizes());
  const int64_t B = q.size(0), N = q.size(2), D = q.size(3);
  TORCH_CHECK(k.size(0) == B && k.size(2) == N && k.size(3) == D && D % 2 == 0 && cos_in.size(1) == N &&
                  cos_in.size(2) == D && (cos_in.size(0) == B || cos_in.size(0) == 1),
              name, ": shapes do not match: q ", q.sizes(), ", k ", k.sizes(), ", cos ", cos_in.sizes());
  const at::Tensor cos = cos_in.stride(2) == 1 ? cos_in : cos_in.contiguous();
  const at::Tensor sin = sin_in.stride(2) == 1 ? sin_in : sin_in.contiguous();
  return {rotate(q, cos, sin), rotate(k, cos, sin)};
}

}  // namespace

TORCH_LIBRARY(promptcache_fused, m) {
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("rotary(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(promptcache_fused, CPU, m) {
  m.impl("silu_mul", &silu_mul);
  m.impl("rotary", &rotary);
}

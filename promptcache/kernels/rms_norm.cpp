// RMSNorm as transformers' Llama-family layers compute it, in one pass over each row (CPU):
// registered as torch.ops.promptcache_norm.rms_norm(x, weight, eps) -> out:
//   x [..., H] float32 or bfloat16 (last dimension contiguous), weight [H] of the same dtype;
//   per row: h = x / sqrt(mean(x^2) + eps) in float32; for bfloat16, h rounded to bfloat16 and
//   out = weight * h rounded to bfloat16 (the stock forward's two roundings: `.to(input_dtype)`,
//   then the bfloat16 product); for float32, out = weight * h.
//
// Why: the stock forward is eight elementwise ops a call (widen, square, mean, add, rsqrt, multiply,
// narrow, multiply), each a pass over the activations and, in bfloat16, each with its own
// conversions: ~0.56 ms for 512 rows of 576 on one core of the 2-core EPYC promptcache is measured
// on, 61 calls a SmolLM2 forward. One pass reads x twice (the sum of squares, then the scaled
// row) and writes out once.
//
// Rounding: float32 to bfloat16 is round to nearest even (as torch's conversion; AVX-512 BF16's
// conversion where the CPU has it, which also flushes subnormals to zero), NaN kept a NaN. The
// sum of squares is float32 in another order than torch's reduction: results agree to rounding,
// not always bit for bit.
//
// Portable C++ (GCC/Clang vector extensions, lowered by -march); threads from ATen's parallel_for.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "vectors.h"

namespace {

using namespace promptcache_vectors;

template <class T>
void rows(const T* x, const T* w, T* out, int64_t n, int64_t h, float eps) {
  at::parallel_for(0, n, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* xr = x + r * h;
      T* o = out + r * h;
      v16 acc = v16{};
      int64_t i = 0;
      for (; i + 16 <= h; i += 16) {
        const v16 v = load(xr + i);
        acc += v * v;
      }
      float sum = 0.0f;
      for (int c = 0; c < 16; ++c) sum += acc[c];
      for (; i < h; ++i) sum += to_float(xr[i]) * to_float(xr[i]);
      const float inv = 1.0f / std::sqrt(sum / static_cast<float>(h) + eps);
      i = 0;
      for (; i + 16 <= h; i += 16) {
        const v16 hv = as_stored(load(xr + i) * splat(inv), xr);  // the stock forward narrows h (bfloat16)
        store(o + i, load(w + i) * hv);
      }
      for (; i < h; ++i) {
        put(o + i, to_float(w[i]) * as_stored(to_float(xr[i]) * inv, xr));
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w_in, double eps) {
  const char* name = "promptcache_norm.rms_norm";
  TORCH_CHECK(x_in.device().is_cpu() && w_in.device().is_cpu(), name, ": CPU tensors only");
  TORCH_CHECK(x_in.scalar_type() == w_in.scalar_type() &&
                  (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16),
              name, ": x and weight must be both float32 or both bfloat16, got ", x_in.scalar_type(), " and ",
              w_in.scalar_type());
  TORCH_CHECK(x_in.dim() >= 1 && w_in.dim() == 1 && x_in.size(-1) == w_in.size(0), name, ": x ", x_in.sizes(),
              " and weight ", w_in.sizes(), " do not match");
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  at::Tensor out = at::empty_like(x);
  const int64_t h = x.size(-1), n = h == 0 ? 0 : x.numel() / h;
  if (n == 0) return out;
  if (x.scalar_type() == at::kFloat)
    rows<float>(x.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(), n, h, static_cast<float>(eps));
  else
    rows<uint16_t>(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()),
                   reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()),
                   reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), n, h, static_cast<float>(eps));
  return out;
}

}  // namespace

TORCH_LIBRARY(promptcache_norm, m) { m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor"); }

TORCH_LIBRARY_IMPL(promptcache_norm, CPU, m) { m.impl("rms_norm", &rms_norm); }

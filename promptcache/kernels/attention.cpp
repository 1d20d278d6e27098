// Attention of float32 or bfloat16 queries over float32 or bfloat16 keys/values on the CPU (float32
// accumulation), returning the log-sum-exp the paged engine merges partial results with
// (engine/serving_core/paged.py). Registered as torch.ops.promptcache_native.attend(q, k, v, scale, causal_t) -> (out, lse):
//   q [X, M, D] float32 or bfloat16, k and v [X, N, D] both float32 or both bfloat16 (last dimension
//   contiguous; other strides free, so the KV pool's blocks are read in place), D a multiple of 16
//   up to 256;
//   causal_t = 0: every query sees every key; causal_t = t > 0: query r sees keys 0 .. r % t
//   (q holds G groups of t consecutive queries over the same t keys);
//   out [X, M, D] = softmax(scale * q k^T) v, lse [X, M] = logsumexp(scale * q k^T) (natural log),
//   both float32;
// and torch.ops.promptcache_native.attend_gather(q, k, v, slots, lengths, scale) -> (out, lse):
//   decode rows over their own keys, read from the pool by slot (no gathered copy):
//   q [X, B, G, D] contiguous float32 or bfloat16, k and v [X, S, D] (a pool layer's buffers),
//   slots int64 [B, W], lengths int64 [B]: queries (x, b, :) see keys slots[b, 0 .. lengths[b]);
//   out [X, B, G, D], lse [X, B, G] (float32). Rows whose slots begin alike read those keys
//   together (bfloat16 queries over a bfloat16 pool: in bfloat16 products, as attend's);
// and torch.ops.promptcache_native.attend_gather_runs(q, k, v, slots, lengths, scale, run_starts, run_src,
//   run_rot, cos, sin, sources, layer) -> (out, lse): attend_gather where a row's slots come in runs
//   (documents read in place, at any position): run i of row b holds slots
//   [run_starts[b, i], run_starts[b, i + 1]) (int64 [B, R]; the last up to lengths[b]) of
//   run_src[b, i] (-1: k and v; s >= 0: sources[s] [L, 2, X, n, D], a store's states, read at layer
//   `layer`), read with the queries rotated by row run_rot[b, i] of cos, sin (float32 [S, r],
//   rotate-half over the first r channels, sin's first half negated; -1: as they are). Runs that
//   several rows read alike (a document: the same source and slots, anywhere in the rows, at any
//   rotation) are read together, each row's queries rotated by its own run, over packed key tiles
//   (run_groups), and merged with the rest of each row by log-sum-exp;
// and torch.ops.promptcache_native.attend_prefill_runs(q, k, v, slots, lengths, scale, run_starts, run_src,
//   run_rot, cos, sin, sources, layer, query_row, limits) -> (out, lse): prefill rows over the same
//   runs, q [X, G, M, D] (M queries), query i of row query_row[i] seeing the first limits[i, j] keys
//   of the row's run j (int64 [M, R]): documents under selective recompute's prompt order and the
//   row's own tokens (causal) in one online softmax; out [X, G, M, D], lse [X, G, M];
// and torch.ops.promptcache_native.attend_limits(q, k, v, scale, limits) -> (out, lse): attend's
//   shapes, query row r (of every head) seeing keys 0 .. limits[r] - 1 (int64 [M], 1 .. N).
//
// Why: torch's fused CPU kernel (_scaled_dot_product_flash_attention_for_cpu) does its products
// through MKL's sgemm, which takes its AVX2 path on AMD CPUs: a third of what oneDNN's linears reach
// on the 2-core EPYC promptcache is measured on (eval/results/attention.md). This is one pass
// of online softmax (flash attention) over tiles that stay in L1: 48 queries x 64 keys, Q K^T and
// P V in register-blocked vector loops (6 query rows x 64 keys, 6 query rows x D; 24 accumulators),
// exp in a vector polynomial, K^T packed once per call (python -m eval.bench_attention measures it).
//
// bfloat16 keys/values (a bfloat16 KV pool) are widened to float32 as they are read (a shift of
// the 16 bits into a float's upper half: exact), so the products and sums are float32 as for a
// float32 pool, with half the bytes read and no converted copy of the pool. bfloat16 queries over
// bfloat16 keys/values (a bfloat16 model's own) take AVX-512 BF16's paired products where the CPU
// has them (scores_dot / values_dot: twice the float32 lane rate), else are widened too.
//
// Portable C++: GCC/Clang vector extensions, lowered to AVX-512, AVX2 or SSE by -march; threads
// from ATen's parallel_for (torch's own pool).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "vectors.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

using namespace promptcache_vectors;

constexpr int kRows = 48;  // queries per tile
constexpr int kKeys = 64;  // keys per tile (4 vectors)
constexpr int kRR = 6;     // query rows per register block: 24 accumulators + 4 operands
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline v16 vmax(v16 a, v16 b) { return a > b ? a : b; }
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)  // __builtin_shufflevector: a shuffle tree
inline float hmax(v16 v) {
  v = vmax(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  v = vmax(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
  return v[0];
}
inline float hsum(v16 v) {
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v[0];
}
#else  // an older GCC: lane by lane
inline float hmax(v16 v) {
  float m = v[0];
  for (int i = 1; i < 16; ++i) m = std::max(m, v[i]);
  return m;
}
inline float hsum(v16 v) {
  float s = 0.0f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}
#endif

// S[RR][kKeys] = scale * Q[RR][D] . Kt[D][kKeys]
template <int ND, int RR>
inline void scores(const float* q, int64_t q_stride, const float* kt, float scale, float* s) {
  v16 acc[RR][4];
  for (int i = 0; i < RR; ++i)
    for (int c = 0; c < 4; ++c) acc[i][c] = v16{};
  for (int d = 0; d < ND * 16; ++d) {
    const float* row = kt + d * kKeys;
    const v16 k0 = load(row), k1 = load(row + 16), k2 = load(row + 32), k3 = load(row + 48);
    for (int i = 0; i < RR; ++i) {
      const v16 qd = splat(q[i * q_stride + d]);
      acc[i][0] += qd * k0;
      acc[i][1] += qd * k1;
      acc[i][2] += qd * k2;
      acc[i][3] += qd * k3;
    }
  }
  const v16 sc = splat(scale);
  for (int i = 0; i < RR; ++i)
    for (int c = 0; c < 4; ++c) store(s + i * kKeys + c * 16, acc[i][c] * sc);
}

// O[RR][D] += P[RR][kn] . V[kn][D] (V float32 or bfloat16; row(j): the address of value row j)
template <int ND, int RR, class Row>
inline void values(const float* p, Row&& row, int kn, float* o) {
  v16 acc[RR][ND];
  for (int i = 0; i < RR; ++i)
    for (int c = 0; c < ND; ++c) acc[i][c] = load(o + i * ND * 16 + c * 16);
  for (int j = 0; j < kn; ++j) {
    const auto* vj = row(j);
    v16 vv[ND];
    for (int c = 0; c < ND; ++c) vv[c] = load(vj + c * 16);
    for (int i = 0; i < RR; ++i) {
      const v16 pij = splat(p[i * kKeys + j]);
      for (int c = 0; c < ND; ++c) acc[i][c] += pij * vv[c];
    }
  }
  for (int i = 0; i < RR; ++i)
    for (int c = 0; c < ND; ++c) store(o + i * ND * 16 + c * 16, acc[i][c]);
}

// The rows left after whole register blocks, in one block of their own (K^T or V read once for them).
template <int ND, int RR, class F>
inline void remainder(int left, F&& f) {
  if constexpr (RR > 1) {
    if (left == RR - 1) return f(std::integral_constant<int, RR - 1>{});
    remainder<ND, RR - 1>(left, f);
  }
}

template <int ND>
void scores_rows(const float* q, int64_t q_stride, const float* kt, float scale, float* s, int rows) {
  int i = 0;
  for (; i + kRR <= rows; i += kRR) scores<ND, kRR>(q + i * q_stride, q_stride, kt, scale, s + i * kKeys);
  remainder<ND, kRR>(rows - i, [&](auto rr) { scores<ND, rr>(q + i * q_stride, q_stride, kt, scale, s + i * kKeys); });
}

// values for `rows` queries in register blocks; row(j): the address of value row j
template <int ND, class Row>
void values_rows(const float* p, Row&& row, int kn, float* o, int rows) {
  constexpr int rr = ND <= 4 ? kRR : 2;  // accumulators and operands stay in 32 vector registers
  int i = 0;
  for (; i + rr <= rows; i += rr) values<ND, rr>(p + i * kKeys, row, kn, o + i * ND * 16);
  remainder<ND, rr>(rows - i, [&](auto r) { values<ND, r>(p + i * kKeys, row, kn, o + i * ND * 16); });
}

// One query row of a key tile in an online softmax: scores si [kKeys] of which the row sees the
// first `see` (<= 0: none, its scores zeroed: they weigh 0 in P V); updates the row's running max
// mx, sum l and output oi (rescaled), leaving exp(s - mx) in si for P V.
template <int ND>
inline void online_row(float* si, int64_t see, float& mx, float& l, float* oi) {
  if (see <= 0) {
    std::memset(si, 0, sizeof(float) * kKeys);
    return;
  }
  // the vectors holding seen keys (the last one's unseen lanes masked to -inf, lane by lane), the
  // others zeroed without an exp (a causal or partial tile: often most of it)
  const int live = static_cast<int>(std::min<int64_t>(see, kKeys) + 15) / 16;
  if (see % 16 != 0 && see < kKeys) {
    const v16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const v16 x = load(si + (live - 1) * 16);
    store(si + (live - 1) * 16, lane < splat(static_cast<float>(see % 16)) ? x : splat(kNegInf));
  }
  v16 m4 = load(si);
  for (int c = 1; c < live; ++c) m4 = vmax(m4, load(si + c * 16));
  const float m_new = std::max(mx, hmax(m4));
  const float alpha = std::exp(mx - m_new);  // 0 on the row's first keys (mx = -inf)
  v16 sum = v16{};
  for (int c = 0; c < live; ++c) {
    const v16 p = vexp(load(si + c * 16) - splat(m_new));
    store(si + c * 16, p);
    sum += p;
  }
  for (int c = live; c < 4; ++c) store(si + c * 16, v16{});
  l = l * alpha + hsum(sum);
  mx = m_new;
  if (alpha != 1.0f)
    for (int c = 0; c < ND; ++c) store(oi + c * 16, load(oi + c * 16) * splat(alpha));
}

// A row's result from its running output oi, max mx and sum l: out = oi / l, lse = mx + log l (a
// row that saw no key: 0 and -inf).
template <int ND>
inline void finish_row(const float* oi, float mx, float l, float* out, float* lse) {
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
  for (int c = 0; c < ND; ++c) store(out + c * 16, load(oi + c * 16) * splat(inv));
  *lse = l > 0.0f ? mx + std::log(l) : kNegInf;
}

// Online-softmax attention of `rows` (<= kRows) queries over keys 0 .. n-1, query i seeing keys
// 0 .. limit[i]; per key tile j0 of kn keys, scores(j0, kn, s) writes s[i][j] = scale * q_i . k_(j0+j)
// (rows i, kKeys columns: finite past kn, they are masked) and values(j0, kn, p, o) adds
// sum_j p[i][j] v_(j0+j) to o[i] (p zero past kn). Writes out rows (stride D) and lse.
template <int ND, class Scores, class Values>
void attend_rows(int rows, const int64_t* limit, int64_t n, Scores&& scores, Values&& values, float* out, float* lse) {
  constexpr int D = ND * 16;
  alignas(64) float s[kRows * kKeys];
  alignas(64) float o[kRows * D];
  float mx[kRows], l[kRows];
  int64_t last = -1;
  for (int i = 0; i < rows; ++i) {
    last = std::max(last, limit[i]);
    mx[i] = kNegInf;
    l[i] = 0.0f;
  }
  std::memset(o, 0, sizeof(float) * rows * D);
  n = std::min(n, last + 1);
  for (int64_t j0 = 0; j0 < n; j0 += kKeys) {
    const int kn = static_cast<int>(std::min<int64_t>(kKeys, n - j0));
    scores(j0, kn, s);
    for (int i = 0; i < rows; ++i)  // the keys of this tile row i sees (none: causal only, they weigh 0)
      online_row<ND>(s + i * kKeys, std::min<int64_t>(kn, limit[i] - j0 + 1), mx[i], l[i], o + i * D);
    values(j0, kn, s, o);
  }
  for (int i = 0; i < rows; ++i) finish_row<ND>(o + i * D, mx[i], l[i], out + i * D, lse + i);
}

#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
// a, b -> the off-diagonal H-lane blocks of the pair swapped (one round of a block transpose)
template <int H, int... I>
inline void swap_blocks(v16& a, v16& b, std::integer_sequence<int, I...>) {
  const v16 lo = __builtin_shufflevector(a, b, ((I & H) == 0 ? I : 16 + I - H)...);
  const v16 hi = __builtin_shufflevector(a, b, ((I & H) == 0 ? I + H : 16 + I)...);
  a = lo;
  b = hi;
}

template <int H>
inline void swap_round(v16* r) {
  for (int i = 0; i < 16; ++i)
    if ((i & H) == 0) swap_blocks<H>(r[i], r[i + H], std::make_integer_sequence<int, 16>{});
}

// r[i][l] -> r[l][i]: a 16 x 16 block transposed in registers (four rounds of block swaps)
inline void transpose16(v16* r) {
  swap_round<8>(r);
  swap_round<4>(r);
  swap_round<2>(r);
  swap_round<1>(r);
}

// K^T of one key tile (kn keys, row pointers from key(j)) into kt [D][kKeys], zeros after kn
// (Pad) or finite values there (whatever kt held, or zeros): 16 keys x 16 dims at a time,
// transposed in registers (bfloat16 widened as loaded).
template <int D, bool Pad, class Key>
inline void pack_tile(float* kt, int kn, Key&& key) {
  v16 r[16];
  for (int j0 = 0; j0 < kKeys; j0 += 16) {
    if (!Pad && j0 >= kn) break;
    for (int c = 0; c < D / 16; ++c) {
      for (int i = 0; i < 16; ++i) r[i] = j0 + i < kn ? load(key(j0 + i) + c * 16) : v16{};
      transpose16(r);
      for (int i = 0; i < 16; ++i) store(kt + (c * 16 + i) * kKeys + j0, r[i]);
    }
  }
}
#else  // an older GCC: element by element
template <int D, bool Pad, class Key>
inline void pack_tile(float* kt, int kn, Key&& key) {
  for (int j = 0; j < kn; ++j) {
    const auto* kj = key(j);
    for (int d = 0; d < D; ++d) kt[d * kKeys + j] = to_float(kj[d]);
  }
  if constexpr (Pad)
    for (int d = 0; d < D; ++d)
      for (int j = kn; j < kKeys; ++j) kt[d * kKeys + j] = 0.0f;
}
#endif

#if defined(__AVX512BF16__)
// bfloat16 products with float32 sums (AVX-512 BF16's vdpbf16ps: the products of two pairs of
// bfloat16 numbers added to a float32 lane, twice the float32 lane rate) for bfloat16 queries over
// a bfloat16 pool: the scores of exact bfloat16 queries and keys are float32 sums of exact
// products (as the widened path's), the probabilities are rounded to bfloat16 before P V (as
// torch's bfloat16 attention does). Tiles are packed in pairs: K^T as [D/2][kKeys][2] (the pair
// 2p, 2p+1 of one key's dims), V as [kKeys/2][D][2] (the pair of keys 2jp, 2jp+1 for one dim).
constexpr bool kDot = true;

inline __m512bh pairs(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline __m512bh broadcast_pair(const uint16_t* p) {
  uint32_t pair;
  std::memcpy(&pair, p, sizeof pair);
  return (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
}

// S[RR][kKeys] = scale * Q[RR][D] . Kt (bfloat16 Q rows, K^T tile in pairs)
template <int ND, int RR>
inline void scores_dot(const uint16_t* q, int64_t q_stride, const uint16_t* kt, float scale, float* s) {
  __m512 acc[RR][4];
  for (int i = 0; i < RR; ++i)
    for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_setzero_ps();
  for (int p = 0; p < ND * 8; ++p) {
    const uint16_t* row = kt + p * kKeys * 2;
    const __m512bh k0 = pairs(row), k1 = pairs(row + 32), k2 = pairs(row + 64), k3 = pairs(row + 96);
    for (int i = 0; i < RR; ++i) {
      const __m512bh qd = broadcast_pair(q + i * q_stride + 2 * p);
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], qd, k0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], qd, k1);
      acc[i][2] = _mm512_dpbf16_ps(acc[i][2], qd, k2);
      acc[i][3] = _mm512_dpbf16_ps(acc[i][3], qd, k3);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int i = 0; i < RR; ++i)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(s + i * kKeys + c * 16, _mm512_mul_ps(acc[i][c], sc));
}

// O[RR][D] += P[RR][kn] . V (P rows in bfloat16, zero past kn; the V tile in pairs)
template <int ND, int RR>
inline void values_dot(const uint16_t* p, const uint16_t* vt, int kn, float* o) {
  __m512 acc[RR][ND];
  for (int i = 0; i < RR; ++i)
    for (int c = 0; c < ND; ++c) acc[i][c] = _mm512_loadu_ps(o + i * ND * 16 + c * 16);
  for (int jp = 0; jp < (kn + 1) / 2; ++jp) {
    const uint16_t* vj = vt + jp * ND * 32;
    __m512bh vv[ND];
    for (int c = 0; c < ND; ++c) vv[c] = pairs(vj + c * 32);
    for (int i = 0; i < RR; ++i) {
      const __m512bh pij = broadcast_pair(p + i * kKeys + 2 * jp);
      for (int c = 0; c < ND; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], pij, vv[c]);
    }
  }
  for (int i = 0; i < RR; ++i)
    for (int c = 0; c < ND; ++c) _mm512_storeu_ps(o + i * ND * 16 + c * 16, acc[i][c]);
}

template <int ND>
void scores_dot_rows(const uint16_t* q, int64_t q_stride, const uint16_t* kt, float scale, float* s, int rows) {
  int i = 0;
  for (; i + kRR <= rows; i += kRR) scores_dot<ND, kRR>(q + i * q_stride, q_stride, kt, scale, s + i * kKeys);
  remainder<ND, kRR>(rows - i, [&](auto rr) { scores_dot<ND, rr>(q + i * q_stride, q_stride, kt, scale, s + i * kKeys); });
}

// the probabilities p (float32, [rows][kKeys]) rounded to bfloat16 in ph, then O += Ph . V
template <int ND>
void values_dot_rows(const float* p, uint16_t* ph, const uint16_t* vt, int kn, float* o, int rows) {
  for (int i = 0; i < rows; ++i)
    for (int c = 0; c < 4; ++c)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(ph + i * kKeys + c * 16),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p + i * kKeys + c * 16)));
  constexpr int rr = ND <= 4 ? kRR : 2;  // accumulators and operands stay in 32 vector registers
  int i = 0;
  for (; i + rr <= rows; i += rr) values_dot<ND, rr>(ph + i * kKeys, vt, kn, o + i * ND * 16);
  remainder<ND, rr>(rows - i, [&](auto r) { values_dot<ND, r>(ph + i * kKeys, vt, kn, o + i * ND * 16); });
}

// One key tile (kn keys; rows from key(j), val(j)) packed in pairs, zeros past kn. K^T's 32-bit
// pairs are transposed as float32 K^T's floats are (pack_tile over D / 2 lanes of the same bits,
// 16 x 16 in registers) where D / 2 fills whole vectors; V's pairs of key rows interleaved 16 dims at
// a time (each row's 16 bits widened to 32, the second's shifted into the upper half). A tile was
// packed element by element before: as many stores as the products' instructions.
template <int D, class Key, class Val>
inline void pack_tile_dot(uint16_t* kt, uint16_t* vt, int kn, Key&& key, Val&& val) {
  if constexpr (D % 32 == 0) {
    pack_tile<D / 2, true>(reinterpret_cast<float*>(kt), kn,
                           [&](int j) { return reinterpret_cast<const float*>(key(j)); });
  } else {
    for (int j = 0; j < kKeys; ++j) {  // K^T: 32-bit pairs transposed
      uint32_t row[D / 2] = {};
      if (j < kn) std::memcpy(row, key(j), sizeof row);
      for (int p = 0; p < D / 2; ++p) std::memcpy(kt + (p * kKeys + j) * 2, row + p, sizeof(uint32_t));
    }
  }
  const __m256i zero = _mm256_setzero_si256();
  for (int jp = 0; jp < kKeys / 2; ++jp) {
    const uint16_t* a = 2 * jp < kn ? val(2 * jp) : nullptr;
    const uint16_t* b = 2 * jp + 1 < kn ? val(2 * jp + 1) : nullptr;
    for (int c = 0; c < D; c += 16) {
      const __m512i lo = _mm512_cvtepu16_epi32(a != nullptr ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + c)) : zero);
      const __m512i hi = _mm512_cvtepu16_epi32(b != nullptr ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + c)) : zero);
      _mm512_storeu_si512(vt + (jp * D + c) * 2, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}
#else
constexpr bool kDot = false;
#endif

template <class KV, class Q>
struct Args {
  const Q* q;  // float32, or bfloat16 bits (uint16_t) for the paired bfloat16 path
  const KV *k, *v;
  void* packed;  // the key tiles packed once per call: K^T [X][tiles][D][kKeys] float32, or K^T and V in pairs
  float *out, *lse;
  int64_t qs0, qs1, ks0, ks1, vs0, vs1;  // strides (elements) of dims 0 and 1
  int64_t m, n, causal_t;
  float scale;
  const int64_t* limits = nullptr;  // attend_limits: query r sees keys 0 .. limits[r] - 1 (any head)
};

// The packed elements per key tile: K^T in float32, or K^T and V in bfloat16 pairs.
template <class Q>
constexpr int64_t packed_per_tile(int64_t d) { return std::is_same_v<Q, float> ? d * kKeys : 2 * d * kKeys; }

template <int ND, class KV, class Q>
void run(const Args<KV, Q>& a, int64_t heads) {
  constexpr int D = ND * 16;
  constexpr bool dot = !std::is_same_v<Q, float>;
  const int64_t blocks = (a.n + kKeys - 1) / kKeys, per_tile = packed_per_tile<Q>(D);
  // every key tile of every head packed once: every query tile of the head reads it
  at::parallel_for(0, heads * blocks, 4, [&](int64_t b, int64_t e) {
    for (int64_t w = b; w < e; ++w) {
      const int64_t x = w / blocks, j0 = (w % blocks) * kKeys;
      const int kn = static_cast<int>(std::min<int64_t>(kKeys, a.n - j0));
      const KV* k = a.k + x * a.ks0 + j0 * a.ks1;
      if constexpr (dot) {
#if defined(__AVX512BF16__)
        const KV* v = a.v + x * a.vs0 + j0 * a.vs1;
        uint16_t* t = static_cast<uint16_t*>(a.packed) + w * per_tile;
        pack_tile_dot<D>(t, t + D * kKeys, kn, [&](int j) { return k + j * a.ks1; }, [&](int j) { return v + j * a.vs1; });
#endif
      } else {
        pack_tile<D, true>(static_cast<float*>(a.packed) + w * per_tile, kn, [&](int j) { return k + j * a.ks1; });
      }
    }
  });
  // few query tiles (decode rows over a long prompt): the keys are split too, so both threads
  // work, and the splits' partial results merged by log-sum-exp (flash decoding)
  const int64_t tiles = (a.m + kRows - 1) / kRows, items = heads * tiles;
  int64_t splits = 1;
  if (a.causal_t == 0 && items < 4 * at::get_num_threads())
    splits = std::max<int64_t>(1, std::min<int64_t>((4 * at::get_num_threads() + items - 1) / items, blocks / 4));
  const int64_t per = (blocks + splits - 1) / splits * kKeys;  // keys per split: whole key tiles
  splits = (a.n + per - 1) / per;
  at::Tensor part;
  float *po = a.out, *pl = a.lse;
  if (splits > 1) {
    part = at::empty({splits * heads * a.m * (D + 1)}, at::TensorOptions().dtype(at::kFloat));
    po = part.data_ptr<float>();
    pl = po + splits * heads * a.m * D;
  }
  at::parallel_for(0, splits * items, 1, [&](int64_t b, int64_t e) {
    for (int64_t w = b; w < e; ++w) {
      const int64_t sp = w / items, x = (w % items) / tiles, r0 = (w % tiles) * kRows;
      const int64_t k0 = sp * per, kn = std::min(per, a.n - k0);
      const int rows = static_cast<int>(std::min<int64_t>(kRows, a.m - r0));
      int64_t limit[kRows];  // the last key each query sees (from k0)
      for (int i = 0; i < rows; ++i)  // negative: the row sees none of this split's keys
        limit[i] = a.limits != nullptr ? std::min<int64_t>(kn, a.limits[r0 + i] - k0) - 1
                                       : a.causal_t > 0 ? (r0 + i) % a.causal_t : kn - 1;
      const Q* q = a.q + x * a.qs0 + r0 * a.qs1;
      const int64_t block0 = x * blocks + k0 / kKeys;
      auto tile = [&](int64_t j0) { return static_cast<const Q*>(a.packed) + (block0 + j0 / kKeys) * per_tile; };
      float* o = po + ((sp * heads + x) * a.m + r0) * D;
      float* l = pl + (sp * heads + x) * a.m + r0;
      if constexpr (dot) {
#if defined(__AVX512BF16__)
        alignas(64) uint16_t ph[kRows * kKeys];
        attend_rows<ND>(
            rows, limit, kn,
            [&](int64_t j0, int, float* s) { scores_dot_rows<ND>(q, a.qs1, tile(j0), a.scale, s, rows); },
            [&](int64_t j0, int n, const float* p, float* out) { values_dot_rows<ND>(p, ph, tile(j0) + D * kKeys, n, out, rows); },
            o, l);
#endif
      } else {
        const KV* v = a.v + x * a.vs0 + k0 * a.vs1;
        attend_rows<ND>(
            rows, limit, kn,
            [&](int64_t j0, int, float* s) { scores_rows<ND>(q, a.qs1, tile(j0), a.scale, s, rows); },
            [&](int64_t j0, int n, const float* p, float* out) {
              values_rows<ND>(p, [&](int j) { return v + (j0 + j) * a.vs1; }, n, out, rows);
            },
            o, l);
      }
    }
  });
  if (splits == 1) return;
  const int64_t total = heads * a.m;
  at::parallel_for(0, total, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      float top = kNegInf;
      for (int64_t sp = 0; sp < splits; ++sp) top = std::max(top, pl[sp * total + r]);
      v16 acc[ND];
      for (int c = 0; c < ND; ++c) acc[c] = v16{};
      float sum = 0.0f;
      for (int64_t sp = 0; sp < splits; ++sp) {
        const float wgt = std::exp(pl[sp * total + r] - top);
        sum += wgt;
        const float* o = po + (sp * total + r) * D;
        for (int c = 0; c < ND; ++c) acc[c] += load(o + c * 16) * splat(wgt);
      }
      for (int c = 0; c < ND; ++c) store(a.out + r * D + c * 16, acc[c] * splat(1.0f / sum));
      a.lse[r] = top + std::log(sum);
    }
  });
}

// Decode rows over their own keys, gathered from the pool by slot: query row group b (G queries)
// of head x sees keys slots[b, 0 .. lengths[b]).
//
// A group of few queries (G <= kDirectRows: a decode row's query heads of one KV head) reads each
// key and value row in place: a score is one key row's dot product with each query (a horizontal
// sum), P V adds value rows read where they lie (bfloat16 widened as loaded). Packing K^T and V
// per tile, as prefill does, costs more than it saves when only G queries use the tile: decode
// steps over long rows were about half packing (a 16-row step over a 1K shared prompt).
constexpr int kDirectRows = 8;

template <int ND, class KV>
inline void scores_direct(const float* q, int rows, const KV* const* krow, int kn, float scale, float* s) {
  constexpr int D = ND * 16;
  for (int j = 0; j < kn; ++j) {
    v16 kv[ND];
    for (int c = 0; c < ND; ++c) kv[c] = load(krow[j] + c * 16);
    for (int i = 0; i < rows; ++i) {
      const float* qi = q + i * D;
      v16 acc = load(qi) * kv[0];
      for (int c = 1; c < ND; ++c) acc += load(qi + c * 16) * kv[c];
      s[i * kKeys + j] = hsum(acc) * scale;
    }
  }
}

// Decode rows whose slots begin alike (requests over one prompt whose blocks the pool holds once:
// the engine folds those shared slots into each row's own) read the shared keys together: the
// queries of every such row (up to kRows) go through one packed K^T tile, as a prefill's do, so a
// tile is read and packed once for all of them instead of once per row; each row then reads its
// own remaining keys directly and the two partial results merge by log-sum-exp. 16 decode rows
// over a 1K shared prompt spent a third of a step re-reading the prompt's keys row by row.
constexpr int64_t kMinShared = 2 * kKeys;  // fewer shared keys are not worth a pass of their own

struct SharedRun {
  int64_t n;                  // leading slots every row of the run has alike
  std::vector<int64_t> rows;  // rows[0] leads: the shared keys are read through its slots
  int64_t rot = -1, src = -1;  // the rotation its queries read them with and where they lie (Runs)
};

// Where keys and values of a run lie: [X, n, D] (element strides of dims 0 and 1), a layer of the
// pool's buffers or of a store's states read in place.
template <class KV>
struct Source {
  const KV *k, *v;
  int64_t ks0, ks1, vs0, vs1, n;
};

// The sources a gather over runs reads: the pool's k and v (source -1, index 0 here), then layer
// `layer` of each store tensor [L, 2, Hk, n, D] in `sources` (keys [.., 0], values [.., 1]).
template <class KV>
std::vector<Source<KV>> sources_of(const KV* kp, const KV* vp, const at::Tensor& k, const at::Tensor& v,
                                   int64_t slots_n, at::TensorList sources, int64_t layer) {
  std::vector<Source<KV>> src;
  src.push_back({kp, vp, k.stride(0), k.stride(1), v.stride(0), v.stride(1), slots_n});
  for (const at::Tensor& x : sources) {
    const KV* base = reinterpret_cast<const KV*>(static_cast<const char*>(x.data_ptr()));
    const KV* xk = base + layer * x.stride(0);
    src.push_back({xk, xk + x.stride(1), x.stride(2), x.stride(3), x.stride(2), x.stride(3), x.size(3)});
  }
  return src;
}

// Runs of a row's keys (attend_gather_runs): run i of row b holds slots [starts[b, i], starts[b, i + 1])
// (the last: up to lengths[b]) of source src[b, i] (-1: the pool's k and v; s >= 0: sources[s]), read
// with the row's queries rotated by row rot[b, i] of (cos, sin) [S, r] (-1: as they are). A document
// read in place at another position than the one it was encoded at: rotary scores depend on the
// query's and key's positions only through their difference, so the query rotated back by the shift
// reads the stored keys as if moved. Rotate-half form over the first r channels (c pairs with
// c + r / 2), sin's first half negated: q'[c] = q[c] cos[c] + q[c +- r / 2] sin[c]; channels past r
// as they are.
struct Runs {
  const int64_t* starts = nullptr;  // [B, R] (nullptr: no runs, every key the pool's, read as it is)
  const int64_t* rot = nullptr;     // [B, R]
  const int64_t* src = nullptr;     // [B, R]
  int64_t width = 0;                // R
  const float* cos = nullptr;       // [S, r] float32
  const float* sin = nullptr;
  int64_t r = 0;
  int64_t sources = 0;              // how many sources besides the pool

  bool any() const { return starts != nullptr; }
  // one number per (rotation, source): keys alike in slot and tag read alike
  int64_t tag(int64_t b, int64_t i) const { return (rot[b * width + i] + 1) * (sources + 1) + src[b * width + i] + 1; }
};

// One query (D channels; float32 or bfloat16 bits) rotated by row `row` of the runs' (cos, sin):
// widened, rotated in float32 and stored back (bfloat16: rounded to nearest even, as torch's
// .to(bfloat16) rounds it).
// Where half the rotated channels fill whole vectors (r a multiple of 32: every rotary head dim the
// engine runs), 16 channels at a time: the same products and sums, a vector store rounding them (a
// query rotated once per run and query tile was a scalar loop as long as the tile's products).
template <class Q>
inline void rotated_query(const Q* q, const Runs& rt, int64_t row, int64_t d, Q* out) {
  const float* c = rt.cos + row * rt.r;
  const float* sn = rt.sin + row * rt.r;
  const int64_t h = rt.r / 2;
  if (h % 16 == 0) {
    for (int64_t i = 0; i < rt.r; i += 16)
      store(out + i, load(q + i) * load(c + i) + load(q + (i < h ? i + h : i - h)) * load(sn + i));
  } else {
    for (int64_t i = 0; i < rt.r; ++i) put(out + i, to_float(q[i]) * c[i] + to_float(q[i < h ? i + h : i - h]) * sn[i]);
  }
  for (int64_t i = rt.r; i < d; ++i) out[i] = q[i];
}

// Runs of >= 2 rows sharing >= kMinShared leading slots, read alike (with runs: the same source and
// rotation, up to the leader's first change of either). Greedy from each row not yet taken: of the
// later rows, the set that maximizes (rows x shared keys) joins it.
std::vector<SharedRun> shared_runs(const int64_t* slots, int64_t width, const int64_t* lengths, int64_t b,
                                   const Runs& rt) {
  std::vector<SharedRun> runs;
  std::vector<char> taken(b, 0);
  std::vector<std::pair<int64_t, int64_t>> alike;  // (leading slots alike with the leader, row)
  // with runs: each row's tag per key (one pass over the runs), compared with the slots
  std::vector<int64_t> tags(rt.any() ? b * width : 0, 0);
  if (rt.any())
    for (int64_t r = 0; r < b; ++r) {
      const int64_t* st = rt.starts + r * rt.width;
      for (int64_t i = 0; i < rt.width; ++i) {
        const int64_t end = i + 1 < rt.width ? st[i + 1] : lengths[r];
        std::fill(tags.begin() + r * width + st[i], tags.begin() + r * width + end, rt.tag(r, i));
      }
    }
  for (int64_t r = 0; r < b; ++r) {
    if (taken[r] || lengths[r] < kMinShared) continue;
    const int64_t* lead = slots + r * width;
    int64_t uniform = lengths[r];  // the leader's keys read with its first tag
    if (rt.any()) {
      const int64_t* kr = tags.data() + r * width;
      uniform = std::find_if(kr, kr + lengths[r], [&](int64_t x) { return x != kr[0]; }) - kr;
      if (uniform < kMinShared) continue;
    }
    alike.clear();
    for (int64_t o = r + 1; o < b; ++o) {
      if (taken[o]) continue;
      const int64_t* other = slots + o * width;
      const int64_t most = std::min({lengths[r], lengths[o], uniform});
      int64_t j = 0;
      if (rt.any()) {
        const int64_t *kr = tags.data() + r * width, *ko = tags.data() + o * width;
        while (j < most && lead[j] == other[j] && kr[j] == ko[j]) ++j;
      } else {
        while (j < most && lead[j] == other[j]) ++j;
      }
      if (j >= kMinShared) alike.emplace_back(j, o);
    }
    if (alike.empty()) continue;
    std::sort(alike.begin(), alike.end(), [](const auto& a, const auto& c) { return a.first > c.first; });
    size_t best = 0;
    for (size_t i = 1; i < alike.size(); ++i)
      if ((i + 2) * alike[i].first > (best + 2) * alike[best].first) best = i;
    SharedRun run{alike[best].first, {r}};
    if (rt.any()) {  // the leader's first run holds its first key
      run.rot = rt.rot[r * rt.width];
      run.src = rt.src[r * rt.width];
      for (int64_t i = 0; i < rt.width && rt.starts[r * rt.width + i] == 0; ++i) {
        run.rot = rt.rot[r * rt.width + i];  // empty runs at 0 come before the first key's run
        run.src = rt.src[r * rt.width + i];
      }
    }
    for (size_t i = 0; i <= best; ++i) {
      run.rows.push_back(alike[i].second);
      taken[alike[i].second] = 1;
    }
    taken[r] = 1;
    runs.push_back(std::move(run));
  }
  return runs;
}

// A stretch of one row's keys of one source, read with one set of queries: [begin, end) in the row's
// pass (its keys less the runs a group pass read), slot list index = that + delta.
template <class KV>
struct Piece {
  int64_t begin, end, delta, rot;
  const Source<KV>* at;
  const float* q = nullptr;  // the queries it reads with (set per query chunk)
};

// Row `row`'s keys (up to `len`) as pieces of one rotation and source each, less the runs `taken`
// marks (taken[i] != 0: run i was read by a group pass; nullptr: none); adjacent runs alike joined,
// empty ones dropped. Returns the keys the pieces hold.
template <class KV>
inline int64_t pieces_of(const Runs& rt, const std::vector<Source<KV>>& src, int64_t row, int64_t len,
                         const int32_t* taken, std::vector<Piece<KV>>& out) {
  out.clear();
  const int64_t* st = rt.starts + row * rt.width;
  int64_t n = 0;
  for (int64_t i = 0; i < rt.width; ++i) {
    const int64_t a = st[i], e = i + 1 < rt.width ? st[i + 1] : len;
    if (a >= e || (taken != nullptr && taken[i])) continue;
    const int64_t rot = rt.rot[row * rt.width + i];
    const Source<KV>* at = &src[rt.src[row * rt.width + i] + 1];
    if (!out.empty() && out.back().rot == rot && out.back().at == at && out.back().end == n && out.back().delta == a - n)
      out.back().end = n + e - a;
    else
      out.push_back({n, n + e - a, a - n, rot, at});
    n += e - a;
  }
  return n;
}

// Runs several rows read alike (the same keys of one source: a document, a prompt's prefix), at any
// rotation: their queries (each rotated by its row's run) are read together over packed key tiles,
// as a prefill chunk's are, a tile packed once for all of them instead of read once per row. What
// the shared pass does for rows beginning alike, for runs anywhere in the rows.
struct RunGroup {
  int64_t src, n;
  const int64_t* slots;                             // the first member's
  std::vector<std::pair<int64_t, int64_t>> members;  // (row, run)
};

constexpr int64_t kMinGroupKeys = 16;  // shorter runs are read in each row's pass

// Groups of runs alike in source and slots, of at least kMinGroupKeys keys, read by more queries than
// a row's pass reads directly (members x G > kDirectRows). taken[row * R + i]: 1 where run i of the
// row is a group's.
std::vector<RunGroup> run_groups(const Runs& rt, const int64_t* slots, int64_t width, const int64_t* lengths,
                                 int64_t b, int64_t g, std::vector<int32_t>& taken) {
  std::vector<RunGroup> groups;
  // (source, keys, first slot, last slot) -> the groups of runs with them (slots compared in full)
  std::map<std::tuple<int64_t, int64_t, int64_t, int64_t>, std::vector<int64_t>> keyed;
  for (int64_t row = 0; row < b; ++row) {
    const int64_t* st = rt.starts + row * rt.width;
    for (int64_t i = 0; i < rt.width; ++i) {
      const int64_t a = st[i], e = i + 1 < rt.width ? st[i + 1] : lengths[row];
      if (e - a < kMinGroupKeys) continue;
      const int64_t* sl = slots + row * width + a;
      const auto key = std::make_tuple(rt.src[row * rt.width + i], e - a, sl[0], sl[e - a - 1]);
      std::vector<int64_t>& alike = keyed[key];
      int64_t found = -1;
      for (int64_t gi : alike)
        if (std::memcmp(groups[gi].slots, sl, sizeof(int64_t) * (e - a)) == 0) {
          found = gi;
          break;
        }
      if (found < 0) {
        found = static_cast<int64_t>(groups.size());
        groups.push_back({rt.src[row * rt.width + i], e - a, sl, {}});
        alike.push_back(found);
      }
      groups[found].members.emplace_back(row, i);
    }
  }
  std::vector<RunGroup> kept;
  for (RunGroup& grp : groups) {
    if (static_cast<int64_t>(grp.members.size()) * g <= kDirectRows || grp.members.size() < 2) continue;
    for (const auto& [row, i] : grp.members) taken[row * rt.width + i] = 1;
    kept.push_back(std::move(grp));
  }
  return kept;
}

// One pass of shared_runs: queries of one run and head (chunk of up to kRows, split sp of the keys).
struct SharedItem {
  int64_t run, x, c0, sp;
};

// The shared pass's key tile for `rows` gathered queries qs (stride D): float32 queries over K^T
// widened to float32 (kt), or bfloat16 queries over a bfloat16 pool in AVX-512 BF16's pairs (as
// `run`'s prefill tiles: K^T and V packed, probabilities rounded to bfloat16 before P V).
template <int ND, class KV, class Q>
struct SharedTile {
  static constexpr int D = ND * 16;
  static constexpr bool dot = !std::is_same_v<Q, float>;
  std::vector<float> kt;          // float32 K^T [D][kKeys]
  std::vector<uint16_t> pairs;    // bfloat16: K^T and V in pairs, then P rounded [kRows][kKeys]

  SharedTile() {
    if constexpr (dot) pairs.resize(2 * D * kKeys + kRows * kKeys);
    else kt.resize(D * kKeys);
  }

  template <class Row>
  void attend(const Q* qs, int rows, const int64_t* limit, int64_t n, Row&& row, const KV* k, const KV* v,
              int64_t ks1, int64_t vs1, float scale, float* out, float* lse) {
    if constexpr (dot) {
#if defined(__AVX512BF16__)
      uint16_t *kp = pairs.data(), *vp = kp + D * kKeys, *ph = vp + D * kKeys;
      attend_rows<ND>(
          rows, limit, n,
          [&](int64_t j0, int kn, float* s) {
            pack_tile_dot<D>(kp, vp, kn, [&](int j) { return k + row(j0 + j) * ks1; },
                             [&](int j) { return v + row(j0 + j) * vs1; });
            scores_dot_rows<ND>(qs, D, kp, scale, s, rows);
          },
          [&](int64_t, int kn, const float* p, float* o) { values_dot_rows<ND>(p, ph, vp, kn, o, rows); }, out, lse);
#endif
    } else {
      float* t = kt.data();
      attend_rows<ND>(
          rows, limit, n,
          [&](int64_t j0, int kn, float* s) {
            pack_tile<D, true>(t, kn, [&](int j) { return k + row(j0 + j) * ks1; });
            scores_rows<ND>(qs, D, t, scale, s, rows);
          },
          [&](int64_t j0, int kn, const float* p, float* o) {
            values_rows<ND>(p, [&](int j) { return v + row(j0 + j) * vs1; }, kn, o, rows);
          },
          out, lse);
    }
  }
};

// q: float32, or bfloat16 bits (uint16_t) over a bfloat16 pool where the CPU has AVX-512 BF16 (the
// shared pass then takes paired products; a row's own keys are read with its queries widened).
// src[0]: the pool's layer; src[1 + s]: sources[s] (Runs). rt: runs of keys of other sources or read
// with the queries rotated (none: every key the pool's, read with the queries as they are). A
// rotated run costs one rotation of the row's queries per query chunk (D per query), not per key:
// the shared pass rotates its gathered queries (bfloat16 ones rounded back to bfloat16, as torch's
// .to(bfloat16) rounds them), the per-row pass keeps the rotated queries in float32 (widened).
template <int ND, class KV, class Q>
void run_gather(const Q* q, const std::vector<Source<KV>>& src, const int64_t* slots, int64_t width,
                const int64_t* lengths, int64_t heads, int64_t b, int64_t g, float scale, float* out, float* lse,
                const Runs& rt) {
  constexpr int D = ND * 16;
  const bool direct = g <= kDirectRows;
  // rows beginning alike (no runs given), or runs alike anywhere in the rows (runs given)
  const std::vector<SharedRun> runs = rt.any() ? std::vector<SharedRun>{} : shared_runs(slots, width, lengths, b, rt);
  std::vector<int32_t> taken(rt.any() ? b * rt.width : 0, 0);
  const std::vector<RunGroup> groups = rt.any() ? run_groups(rt, slots, width, lengths, b, g, taken)
                                                : std::vector<RunGroup>{};
  std::vector<int64_t> skip(b, 0);  // leading slots of each row read by the shared pass
  for (const SharedRun& run : runs)
    for (int64_t row : run.rows) skip[row] = run.n;

  // the shared pass: partial results [splits][heads][b][g] (D floats + lse) of the runs' rows
  std::vector<SharedItem> items;
  int64_t splits = 1, per = 0;
  at::Tensor part;
  float *po = nullptr, *pl = nullptr;
  if (!runs.empty()) {
    int64_t most = 0, chunks = 0;  // query chunks of kRows over all heads
    for (const SharedRun& run : runs) {
      most = std::max(most, run.n);
      chunks += heads * ((static_cast<int64_t>(run.rows.size()) * g + kRows - 1) / kRows);
    }
    const int64_t tiles = (most + kKeys - 1) / kKeys;
    const int64_t threads = at::get_num_threads();
    if (chunks < 4 * threads) {  // few chunks: split the keys too (flash decoding), so every thread works
      const int64_t most_splits = std::max<int64_t>(1, tiles / 2);
      splits = std::min((4 * threads + chunks - 1) / chunks, most_splits);
      while (splits < most_splits && (chunks * splits) % threads != 0) ++splits;  // as many items for each thread
    }
    per = (tiles + splits - 1) / splits * kKeys;
    for (int64_t ri = 0; ri < static_cast<int64_t>(runs.size()); ++ri)
      for (int64_t sp = 0; sp * per < runs[ri].n; ++sp)
        for (int64_t x = 0; x < heads; ++x)
          for (int64_t c0 = 0; c0 < static_cast<int64_t>(runs[ri].rows.size()) * g; c0 += kRows)
            items.push_back({ri, x, c0, sp});
    part = at::empty({splits * heads * b * g * (D + 1)}, at::TensorOptions().dtype(at::kFloat));
    po = part.data_ptr<float>();
    pl = po + splits * heads * b * g * D;
    std::fill(pl, pl + splits * heads * b * g, kNegInf);  // a split past a run's keys weighs 0
    at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t lo, int64_t hi) {
      SharedTile<ND, KV, Q> tile;
      std::vector<Q> qs(kRows * D);  // the chunk's queries, gathered
      std::vector<float> res(kRows * (D + 1));  // their results, before they are scattered
      float *os = res.data(), *ls = os + kRows * D;
      for (int64_t w = lo; w < hi; ++w) {
        const SharedItem& it = items[w];
        const SharedRun& run = runs[it.run];
        const Source<KV>& from = src[run.src + 1];
        const int64_t* sl = slots + run.rows[0] * width + it.sp * per;
        const int64_t n = std::min(per, run.n - it.sp * per);
        const int rows = static_cast<int>(std::min<int64_t>(kRows, static_cast<int64_t>(run.rows.size()) * g - it.c0));
        int64_t limit[kRows];
        int64_t at[kRows];  // each query's (head, row, g) index
        for (int i = 0; i < rows; ++i) {
          const int64_t qi = it.c0 + i;
          at[i] = (it.x * b + run.rows[qi / g]) * g + qi % g;
          if (run.rot < 0)
            std::memcpy(qs.data() + i * D, q + at[i] * D, sizeof(Q) * D);
          else
            rotated_query(q + at[i] * D, rt, run.rot, D, qs.data() + i * D);
          limit[i] = n - 1;
        }
        tile.attend(qs.data(), rows, limit, n, [&](int64_t j) { return sl[j]; }, from.k + it.x * from.ks0,
                    from.v + it.x * from.vs0, from.ks1, from.vs1, scale, os, ls);
        const int64_t base = it.sp * heads * b * g;
        for (int i = 0; i < rows; ++i) {
          std::memcpy(po + (base + at[i]) * D, os + i * D, sizeof(float) * D);
          pl[base + at[i]] = ls[i];
        }
      }
    });
  }

  // the group pass: partial results [heads][b][R][g] (D floats + lse) of the runs groups read
  at::Tensor grouped;
  float *go = nullptr, *gl = nullptr;
  if (!groups.empty()) {
    struct GroupItem {
      int64_t group, x, c0;
    };
    std::vector<GroupItem> gitems;
    for (int64_t gi = 0; gi < static_cast<int64_t>(groups.size()); ++gi)
      for (int64_t x = 0; x < heads; ++x)
        for (int64_t c0 = 0; c0 < static_cast<int64_t>(groups[gi].members.size()) * g; c0 += kRows)
          gitems.push_back({gi, x, c0});
    const int64_t cells = heads * b * rt.width * g;
    grouped = at::empty({cells * (D + 1)}, at::TensorOptions().dtype(at::kFloat));
    go = grouped.data_ptr<float>();
    gl = go + cells * D;
    at::parallel_for(0, static_cast<int64_t>(gitems.size()), 1, [&](int64_t lo, int64_t hi) {
      SharedTile<ND, KV, Q> tile;
      std::vector<Q> qs(kRows * D);  // the chunk's queries, gathered and rotated
      std::vector<float> res(kRows * (D + 1));
      float *os = res.data(), *ls = os + kRows * D;
      for (int64_t w = lo; w < hi; ++w) {
        const GroupItem& it = gitems[w];
        const RunGroup& grp = groups[it.group];
        const Source<KV>& from = src[grp.src + 1];
        const int rows = static_cast<int>(std::min<int64_t>(kRows, static_cast<int64_t>(grp.members.size()) * g - it.c0));
        int64_t limit[kRows];
        int64_t cell[kRows];  // each query's (head, row, run, g) cell
        for (int i = 0; i < rows; ++i) {
          const int64_t qi = it.c0 + i;
          const auto [row, run] = grp.members[qi / g];
          const int64_t at = (it.x * b + row) * g + qi % g, rot = rt.rot[row * rt.width + run];
          cell[i] = ((it.x * b + row) * rt.width + run) * g + qi % g;
          if (rot < 0)
            std::memcpy(qs.data() + i * D, q + at * D, sizeof(Q) * D);
          else
            rotated_query(q + at * D, rt, rot, D, qs.data() + i * D);
          limit[i] = grp.n - 1;
        }
        tile.attend(qs.data(), rows, limit, grp.n, [&](int64_t j) { return grp.slots[j]; }, from.k + it.x * from.ks0,
                    from.v + it.x * from.vs0, from.ks1, from.vs1, scale, os, ls);
        for (int i = 0; i < rows; ++i) {
          std::memcpy(go + cell[i] * D, os + i * D, sizeof(float) * D);
          gl[cell[i]] = ls[i];
        }
      }
    });
  }

  // each row's own keys (past those the shared pass read), one work item per head and row
  at::parallel_for(0, heads * b, 1, [&](int64_t lo, int64_t hi) {
    alignas(64) float kt[D * kKeys];
    alignas(64) float vt[kKeys * D];
    const KV* krow[kKeys];
    const KV* vrow[kKeys];
    std::vector<float> widened(std::is_same_v<Q, float> ? 0 : kRows * D);  // bfloat16 queries as float32
    std::vector<Piece<KV>> pieces;  // with runs: the row's keys by source and rotation
    std::vector<float> turned;      // the rotated queries of each piece ([pieces][rows][D])
    std::vector<float> cols(direct || !rt.any() ? 0 : kRows * kKeys);  // packed tiles: one piece's scores
    if (!direct) std::memset(kt, 0, sizeof kt);  // finite from the start: tiles are packed without padding
    for (int64_t w = lo; w < hi; ++w) {
      const int64_t x = w / b, row = w % b;
      const int64_t n = rt.any() ? pieces_of(rt, src, row, lengths[row], groups.empty() ? nullptr : &taken[row * rt.width],
                                             pieces)
                                 : lengths[row] - skip[row];
      const int64_t* sl = slots + row * width + skip[row];
      if (n == 0) {  // the shared or group pass read all of this row's keys
        std::memset(out + w * g * D, 0, sizeof(float) * g * D);
        std::fill(lse + w * g, lse + (w + 1) * g, kNegInf);
        continue;
      }
      // the pool's keys only, read with the queries as they are: the path without runs
      const bool plain = !rt.any() || (pieces.size() == 1 && pieces[0].rot < 0 && pieces[0].at == &src[0] &&
                                       pieces[0].delta == 0);
      const KV* k = src[0].k + x * src[0].ks0;
      const KV* v = src[0].v + x * src[0].vs0;
      const int64_t ks1 = src[0].ks1, vs1 = src[0].vs1;
      // the tile's key and value rows (from each piece's source), read in place
      const auto rows_of = [&](int64_t j0, int kn) {
        if (plain) {
          for (int j = 0; j < kn; ++j) {
            krow[j] = k + sl[j0 + j] * ks1;
            vrow[j] = v + sl[j0 + j] * vs1;
          }
          return;
        }
        for (const Piece<KV>& pc : pieces) {
          const int64_t a = std::max(pc.begin, j0), e = std::min<int64_t>(pc.end, j0 + kn);
          const KV* pk = pc.at->k + x * pc.at->ks0;
          const KV* pv = pc.at->v + x * pc.at->vs0;
          for (int64_t j = a; j < e; ++j) {
            krow[j - j0] = pk + sl[j + pc.delta] * pc.at->ks1;
            vrow[j - j0] = pv + sl[j + pc.delta] * pc.at->vs1;
          }
        }
      };
      for (int64_t r0 = 0; r0 < g; r0 += kRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kRows, g - r0));
        const float* qr;
        if constexpr (std::is_same_v<Q, float>) {
          qr = q + (w * g + r0) * D;
        } else {
          for (int e = 0; e < rows * D; e += 16) store(widened.data() + e, load(q + (w * g + r0) * D + e));
          qr = widened.data();
        }
        if (!plain) {  // each piece's queries: rotated once for the chunk (float32), or as they are
          turned.resize(pieces.size() * rows * D);
          for (size_t pi = 0; pi < pieces.size(); ++pi) {
            Piece<KV>& pc = pieces[pi];
            if (pc.rot < 0) {
              pc.q = qr;
              continue;
            }
            float* t = turned.data() + pi * rows * D;
            for (int i = 0; i < rows; ++i) rotated_query(qr + i * D, rt, pc.rot, D, t + i * D);
            pc.q = t;
          }
        }
        int64_t limit[kRows];
        for (int i = 0; i < rows; ++i) limit[i] = n - 1;
        const auto run = [&](auto&& scores, auto&& values) {
          attend_rows<ND>(rows, limit, n, scores, values, out + (w * g + r0) * D, lse + w * g + r0);
        };
        if (direct)
          run(
              [&](int64_t j0, int kn, float* s) {
                rows_of(j0, kn);
                if (plain) return scores_direct<ND>(qr, rows, krow, kn, scale, s);
                for (const Piece<KV>& pc : pieces) {  // the tile's keys of each piece, with its queries
                  const int64_t a = std::max(pc.begin, j0), e = std::min<int64_t>(pc.end, j0 + kn);
                  if (a < e) scores_direct<ND>(pc.q, rows, krow + (a - j0), static_cast<int>(e - a), scale, s + (a - j0));
                }
              },
              [&](int64_t, int kn, const float* p, float* o) {
                values_rows<ND>(p, [&](int j) { return vrow[j]; }, kn, o, rows);
              });
        else
          run(
              [&](int64_t j0, int kn, float* s) {  // the tile packed here: K^T, V rows (bfloat16: widened)
                rows_of(j0, kn);
                pack_tile<D, false>(kt, kn, [&](int j) { return krow[j]; });
                for (int j = 0; j < kn; ++j)
                  for (int c = 0; c < ND; ++c) store(vt + j * D + c * 16, load(vrow[j] + c * 16));
                if (plain) return scores_rows<ND>(qr, D, kt, scale, s, rows);
                for (const Piece<KV>& pc : pieces) {  // the tile's scores with each piece's queries, its columns kept
                  const int64_t a = std::max(pc.begin, j0), e = std::min<int64_t>(pc.end, j0 + kn);
                  if (a >= e) continue;
                  scores_rows<ND>(pc.q, D, kt, scale, cols.data(), rows);
                  for (int i = 0; i < rows; ++i)
                    std::memcpy(s + i * kKeys + (a - j0), cols.data() + i * kKeys + (a - j0), sizeof(float) * (e - a));
                }
              },
              [&](int64_t, int kn, const float* p, float* o) {
                values_rows<ND>(p, [&](int j) { return vt + j * D; }, kn, o, rows);
              });
      }
    }
  });
  if (!groups.empty()) {  // each row's own result merged with its runs' group results by log-sum-exp
    at::parallel_for(0, heads * b, 4, [&](int64_t lo, int64_t hi) {
      for (int64_t w = lo; w < hi; ++w) {
        const int64_t row = w % b;
        const int32_t* tk = &taken[row * rt.width];
        if (std::none_of(tk, tk + rt.width, [](int32_t t) { return t != 0; })) continue;
        for (int64_t gq = 0; gq < g; ++gq) {
          const int64_t r = w * g + gq;
          float top = lse[r];
          for (int64_t i = 0; i < rt.width; ++i)
            if (tk[i]) top = std::max(top, gl[(w * rt.width + i) * g + gq]);
          const float own = lse[r] == kNegInf ? 0.0f : std::exp(lse[r] - top);
          float sum = own;
          v16 acc[ND];
          for (int c = 0; c < ND; ++c) acc[c] = load(out + r * D + c * 16) * splat(own);
          for (int64_t i = 0; i < rt.width; ++i) {
            if (!tk[i]) continue;
            const int64_t cell = (w * rt.width + i) * g + gq;
            const float wgt = std::exp(gl[cell] - top);
            sum += wgt;
            for (int c = 0; c < ND; ++c) acc[c] += load(go + cell * D + c * 16) * splat(wgt);
          }
          for (int c = 0; c < ND; ++c) store(out + r * D + c * 16, acc[c] * splat(1.0f / sum));
          lse[r] = top + std::log(sum);
        }
      }
    });
  }
  if (runs.empty()) return;


  // the runs' rows: their own keys' result merged with the shared pass's splits by log-sum-exp
  at::parallel_for(0, heads * b, 4, [&](int64_t lo, int64_t hi) {
    for (int64_t w = lo; w < hi; ++w) {
      if (skip[w % b] == 0) continue;
      for (int64_t r = w * g; r < (w + 1) * g; ++r) {
        float top = lse[r];
        for (int64_t sp = 0; sp < splits; ++sp) top = std::max(top, pl[sp * heads * b * g + r]);
        const float own = lse[r] == kNegInf ? 0.0f : std::exp(lse[r] - top);
        float sum = own;
        v16 acc[ND];
        for (int c = 0; c < ND; ++c) acc[c] = load(out + r * D + c * 16) * splat(own);
        for (int64_t sp = 0; sp < splits; ++sp) {
          const float l = pl[sp * heads * b * g + r];
          if (l == kNegInf) continue;
          const float wgt = std::exp(l - top);
          sum += wgt;
          const float* o = po + (sp * heads * b * g + r) * D;
          for (int c = 0; c < ND; ++c) acc[c] += load(o + c * 16) * splat(wgt);
        }
        for (int c = 0; c < ND; ++c) store(out + r * D + c * 16, acc[c] * splat(1.0f / sum));
        lse[r] = top + std::log(sum);
      }
    }
  });
}


// Prefill rows over runs of their keys (attend_prefill_runs): query qi of row qrow[qi] sees the first
// limits[qi, i] keys of its row's run i (a document's prefix under selective recompute's prompt
// order, causal over the row's own tokens), each run read with the query rotated by the run's
// rotation (Runs), ONE online softmax over all of them. A work item is one head and a block of
// consecutive queries of one row (all their query heads), read in query tiles of up to kRows: each
// key tile of the row's runs is packed once for the block (when a query tile first reads it) and
// kept for the block's later query tiles, scored with each tile's queries rotated once per run,
// masked past each query's limit; key tiles past a query tile's longest limit are not read. A row's
// queries are one block unless the items would not keep the threads busy: then each row's query
// tiles are split in a few blocks (each packing the tiles it reads). A key tile was packed once per
// query tile before: a row of 97 recomputed queries packed each of its documents' tiles 7 times.
// q float32: float32 queries (rotated in float32), products and sums. q bfloat16 bits (uint16_t, a
// bfloat16 model's queries over its bfloat16 pool where the CPU has AVX-512 BF16): K^T and V packed
// in pairs, the queries rotated in float32 and rounded back to bfloat16 (as torch's .to(bfloat16),
// as the decode group pass does), bfloat16 products summed in float32, the probabilities rounded to
// bfloat16 before P V (as the causal call's and torch's bfloat16 attention): twice the float32 lane rate.
struct PrefillItem {
  int64_t x, q0, q1, g0, g1;  // head x, queries [q0, q1) of one row, query heads [g0, g1)
};

template <int ND, class KV, class Q>
void run_prefill(const Q* q, const std::vector<Source<KV>>& src, const int64_t* slots, int64_t width,
                 const int64_t* lengths, int64_t heads, int64_t g, int64_t m, const int64_t* qrow,
                 const int64_t* limits, float scale, float* out, float* lse, const Runs& rt) {
  constexpr int D = ND * 16;
  constexpr bool dot = !std::is_same_v<Q, float>;
  constexpr int64_t per_tile = packed_per_tile<Q>(D);  // packed elements of a key tile (Q's type)
  const int64_t R = rt.width;
  const int64_t per = std::max<int64_t>(1, kRows / g), gh = std::min<int64_t>(g, kRows);
  // the rows' query ranges; blocks per range: enough items for 4 per thread where the rows are few
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (int64_t q0 = 0; q0 < m;) {
    int64_t q1 = q0 + 1;
    while (q1 < m && qrow[q1] == qrow[q0]) ++q1;
    ranges.emplace_back(q0, q1);
    q0 = q1;
  }
  const int64_t chunks = heads * static_cast<int64_t>(ranges.size()) * ((g + gh - 1) / gh);
  const int64_t want = (4 * at::get_num_threads() + chunks - 1) / chunks;  // blocks a range (at most its tiles)
  std::vector<PrefillItem> items;
  for (int64_t x = 0; x < heads; ++x)
    for (const auto& [r0, r1] : ranges) {
      const int64_t tiles = (r1 - r0 + per - 1) / per, blocks = std::min(tiles, want);
      for (int64_t k = 0; k < blocks; ++k) {
        const int64_t q0 = r0 + tiles * k / blocks * per, q1 = std::min(r1, r0 + tiles * (k + 1) / blocks * per);
        for (int64_t g0 = 0; g0 < g; g0 += gh) items.push_back({x, q0, q1, g0, std::min(g, g0 + gh)});
      }
    }
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> buf(2 * kRows * D + kRows * D + kRows * kKeys + 64);
    float* base = buf.data() + (64 - reinterpret_cast<uintptr_t>(buf.data()) / sizeof(float) % 16) % 16;
    float *o = base + 2 * kRows * D, *s = o + kRows * D;
    // the tile's queries and their rotation: float32 in `buf`, bfloat16 bits in `half` (with the
    // rounded probabilities)
    std::vector<uint16_t> half(dot ? 2 * kRows * D + kRows * kKeys : 0);
    Q* qg;
    if constexpr (dot) {
      qg = half.data();
    } else {
      qg = base;
    }
    Q* qr = qg + kRows * D;
    // the block's packed key tiles (K^T in float32, or K^T and V in pairs): run i's tile t at
    // packed + (first[i] + t) * per_tile, packed once (done[first[i] + t])
    std::vector<Q> packed;
    std::vector<int64_t> first(R + 1);
    std::vector<char> done;
    float mx[kRows], l[kRows];
    int64_t lim[kRows];
    for (int64_t w = lo; w < hi; ++w) {
      const PrefillItem& it = items[w];
      const int64_t gn = it.g1 - it.g0, b = qrow[it.q0];
      const int64_t* st = rt.starts + b * R;
      const int64_t* sl = slots + b * width;
      for (int64_t ri = 0; ri < R; ++ri) {
        const int64_t keys = (ri + 1 < R ? st[ri + 1] : lengths[b]) - st[ri];
        first[ri + 1] = first[ri] + (keys + kKeys - 1) / kKeys;
      }
      if (static_cast<int64_t>(packed.size()) < first[R] * per_tile) packed.resize(first[R] * per_tile + 64);
      Q* pk = packed.data() + (64 - reinterpret_cast<uintptr_t>(packed.data()) % 64) % 64 / sizeof(Q);
      done.assign(first[R], 0);
      for (int64_t t0 = it.q0; t0 < it.q1; t0 += per) {
        const int64_t t1 = std::min(it.q1, t0 + per);
        const int rows = static_cast<int>((t1 - t0) * gn);
        auto at = [&](int i) { return ((it.x * g + it.g0 + i % gn) * m + t0 + i / gn); };  // tile row -> output row
        for (int i = 0; i < rows; ++i) {
          std::memcpy(qg + i * D, q + at(i) * D, sizeof(Q) * D);
          mx[i] = kNegInf;
          l[i] = 0.0f;
        }
        std::memset(o, 0, sizeof(float) * rows * D);
        for (int64_t ri = 0; ri < R; ++ri) {
          const int64_t a = st[ri], e = ri + 1 < R ? st[ri + 1] : lengths[b];
          int64_t n = 0;
          for (int i = 0; i < rows; ++i) {
            lim[i] = limits[(t0 + i / gn) * R + ri];
            n = std::max(n, lim[i]);
          }
          n = std::min(n, e - a);
          if (n <= 0) continue;
          const int64_t rot = rt.rot[b * R + ri];
          const Source<KV>& from = src[rt.src[b * R + ri] + 1];
          const Q* qs = qg;
          if (rot >= 0) {
            for (int i = 0; i < rows; ++i) rotated_query(qg + i * D, rt, rot, D, qr + i * D);
            qs = qr;
          }
          const KV* k = from.k + it.x * from.ks0;
          const KV* v = from.v + it.x * from.vs0;
          for (int64_t j0 = 0; j0 < n; j0 += kKeys) {
            const int kn = static_cast<int>(std::min<int64_t>(kKeys, n - j0));
            const int64_t tile = first[ri] + j0 / kKeys;
            Q* kt = pk + tile * per_tile;
            const int full = static_cast<int>(std::min<int64_t>(kKeys, e - a - j0));  // the tile's keys, packed once
            const auto see = [&] {  // the keys of this tile row i sees
              for (int i = 0; i < rows; ++i)
                online_row<ND>(s + i * kKeys, std::min<int64_t>(kn, lim[i] - j0), mx[i], l[i], o + i * D);
            };
            if constexpr (dot) {
#if defined(__AVX512BF16__)
              uint16_t *vp = kt + D * kKeys, *ph = qr + kRows * D;
              if (!done[tile])
                pack_tile_dot<D>(kt, vp, full, [&](int j) { return k + sl[a + j0 + j] * from.ks1; },
                                 [&](int j) { return v + sl[a + j0 + j] * from.vs1; });
              scores_dot_rows<ND>(qs, D, kt, scale, s, rows);
              see();
              values_dot_rows<ND>(s, ph, vp, kn, o, rows);
#endif
            } else {
              if (!done[tile]) pack_tile<D, true>(kt, full, [&](int j) { return k + sl[a + j0 + j] * from.ks1; });
              scores_rows<ND>(qs, D, kt, scale, s, rows);
              see();
              values_rows<ND>(s, [&](int j) { return v + sl[a + j0 + j] * from.vs1; }, kn, o, rows);
            }
            done[tile] = 1;
          }
        }
        for (int i = 0; i < rows; ++i) finish_row<ND>(o + i * D, mx[i], l[i], out + at(i) * D, lse + at(i));
      }
    }
  });
}

template <class F>
void by_head_dim(int64_t d, F&& f) {
  switch (d / 16) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    case 9: f(std::integral_constant<int, 9>{}); break;
    case 10: f(std::integral_constant<int, 10>{}); break;
    case 11: f(std::integral_constant<int, 11>{}); break;
    case 12: f(std::integral_constant<int, 12>{}); break;
    case 13: f(std::integral_constant<int, 13>{}); break;
    case 14: f(std::integral_constant<int, 14>{}); break;
    case 15: f(std::integral_constant<int, 15>{}); break;
    case 16: f(std::integral_constant<int, 16>{}); break;
  }
}

// f(k's elements, v's elements) as float32 or as bfloat16 bits (uint16_t), by their dtype
template <class F>
void by_kv_type(const at::Tensor& k, const at::Tensor& v, F&& f) {
  if (k.scalar_type() == at::kBFloat16)
    f(reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>()), reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>()));
  else
    f(static_cast<const float*>(k.data_ptr<float>()), static_cast<const float*>(v.data_ptr<float>()));
}

void check_common(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const char* name) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), name, ": CPU tensors only");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, name, ": q must be float32 or bfloat16");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16),
              name, ": k and v must be both float32 or both bfloat16");
  const int64_t d = q.size(-1);
  TORCH_CHECK(d % 16 == 0 && d >= 16 && d <= 256, name, ": head dim ", d, " is not a multiple of 16 up to 256");
  TORCH_CHECK(q.stride(-1) == 1 && k.stride(-1) == 1 && v.stride(-1) == 1, name, ": the last dimension must be contiguous");
}

// The optional arguments of attend_gather_runs (absent for attend_gather).
struct RunArgs {
  const at::Tensor *starts, *src, *rot, *cos, *sin;
  at::TensorList sources;
  int64_t layer;
};

// The runs' arguments (RunArgs) checked against rows b of slots [b, width] up to lengths len, over
// the pool's k (slots_n tokens, heads, head dim d); bound: tokens of each source (the pool's first).
Runs checked_runs(const RunArgs* ra, int64_t b, const int64_t* sl, int64_t width, const int64_t* len, int64_t heads,
                  int64_t d, const at::Tensor& k, std::vector<int64_t>& bound, const char* name) {
  Runs rt;
  const at::Tensor *st = ra->starts, *sr = ra->src, *ro = ra->rot, *co = ra->cos, *si = ra->sin;
  TORCH_CHECK(st->device().is_cpu() && sr->device().is_cpu() && ro->device().is_cpu() && co->device().is_cpu() &&
                  si->device().is_cpu(), name, ": run_starts, run_src, run_rot, cos and sin must be CPU tensors");
  TORCH_CHECK(st->scalar_type() == at::kLong && sr->scalar_type() == at::kLong && ro->scalar_type() == at::kLong &&
                  st->dim() == 2 && st->size(0) == b && st->size(1) >= 1 && sr->sizes() == st->sizes() &&
                  ro->sizes() == st->sizes() && st->is_contiguous() && sr->is_contiguous() && ro->is_contiguous(),
              name, ": run_starts, run_src and run_rot must be contiguous int64 [B, R], B = ", b, ", R >= 1; got ",
              st->scalar_type(), " ", st->sizes(), ", ", sr->scalar_type(), " ", sr->sizes(), " and ",
              ro->scalar_type(), " ", ro->sizes());
  TORCH_CHECK(co->scalar_type() == at::kFloat && si->scalar_type() == at::kFloat && co->dim() == 2 &&
                  si->sizes() == co->sizes() && co->is_contiguous() && si->is_contiguous(),
              name, ": cos and sin must be contiguous float32 [S, r] of one shape; got ", co->scalar_type(), " ",
              co->sizes(), " and ", si->scalar_type(), " ", si->sizes());
  const int64_t r = co->size(1), rows_n = co->size(0);
  TORCH_CHECK(rows_n == 0 || (r % 2 == 0 && r >= 2 && r <= d), name, ": the rotary width r = ", r,
              " (cos and sin [S, r]) must be even, 2 .. ", d, " (the head dim)");
  for (size_t i = 0; i < ra->sources.size(); ++i) {
    const at::Tensor& x = ra->sources[i];
    TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == k.scalar_type() && x.dim() == 5 && x.size(0) > ra->layer &&
                    ra->layer >= 0 && x.size(1) == 2 && x.size(2) == heads && x.size(4) == d && x.stride(4) == 1,
                name, ": sources[", i, "] must be ", k.scalar_type(), " [L, 2, ", heads, ", n, ", d,
                "] with L > layer ", ra->layer, " and its last dimension contiguous; got ", x.scalar_type(), " ",
                x.sizes(), " strides ", x.strides());
    bound.push_back(x.size(3));
  }
  rt.width = st->size(1);
  rt.starts = st->data_ptr<int64_t>();
  rt.src = sr->data_ptr<int64_t>();
  rt.rot = ro->data_ptr<int64_t>();
  rt.cos = co->data_ptr<float>();
  rt.sin = si->data_ptr<float>();
  rt.r = r;
  rt.sources = static_cast<int64_t>(ra->sources.size());
  for (int64_t i = 0; i < b; ++i) {
    const int64_t* s0 = rt.starts + i * rt.width;
    TORCH_CHECK(s0[0] == 0, name, ": row ", i, "'s first run starts at ", s0[0], " (must be 0)");
    for (int64_t j = 0; j < rt.width; ++j) {
      const int64_t end = j + 1 < rt.width ? s0[j + 1] : len[i];
      TORCH_CHECK(s0[j] <= end && end <= len[i], name, ": row ", i, " run ", j, " starts at ", s0[j],
                  " (runs start in order, at most at the row's length ", len[i], ")");
      const int64_t rot = rt.rot[i * rt.width + j], from = rt.src[i * rt.width + j];
      TORCH_CHECK(rot >= -1 && rot < rows_n, name, ": row ", i, " run ", j, " reads rotation ", rot,
                  " (cos and sin hold ", rows_n, "; -1: none)");
      TORCH_CHECK(from >= -1 && from < rt.sources, name, ": row ", i, " run ", j, " reads source ", from, " (",
                  rt.sources, " sources; -1: the pool)");
      for (int64_t x = s0[j]; x < end; ++x)
        TORCH_CHECK(sl[i * width + x] >= 0 && sl[i * width + x] < bound[from + 1], name, ": row ", i, " slot ",
                    sl[i * width + x], " is outside the ", bound[from + 1], " slots of ",
                    from < 0 ? "k and v" : "its source");
    }
  }
  return rt;
}

std::tuple<at::Tensor, at::Tensor> gather_checked(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v,
                                                  const at::Tensor& slots, const at::Tensor& lengths, double scale,
                                                  const char* name, const RunArgs* ra) {
  TORCH_CHECK(q_in.dim() == 4 && k.dim() == 3 && v.dim() == 3, name, ": q must be [X, B, G, D], k and v [X, S, D]");
  check_common(q_in, k, v, name);
  // bfloat16 queries over a bfloat16 pool: the shared pass in bfloat16 products where the CPU has
  // them; anything else with float32 queries (a bfloat16 query widened is exact)
  const bool dot = kDot && q_in.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16;
  const at::Tensor q = dot || q_in.scalar_type() == at::kFloat ? q_in : q_in.to(at::kFloat);
  const int64_t heads = q.size(0), b = q.size(1), g = q.size(2), d = q.size(3), slots_n = k.size(1);
  TORCH_CHECK(q.is_contiguous(), name, ": q must be contiguous");
  TORCH_CHECK(k.size(0) == heads && v.size(0) == heads && v.size(1) == slots_n && k.size(2) == d && v.size(2) == d,
              name, ": q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes(), " do not match");
  TORCH_CHECK(slots.device().is_cpu() && lengths.device().is_cpu() && slots.scalar_type() == at::kLong &&
                  lengths.scalar_type() == at::kLong && slots.dim() == 2 && slots.size(0) == b && slots.is_contiguous() &&
                  lengths.dim() == 1 && lengths.size(0) == b && lengths.is_contiguous(),
              name, ": slots must be int64 [B, W] and lengths int64 [B], B = ", b);
  const int64_t width = slots.size(1);
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t* len = lengths.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i)
    TORCH_CHECK(len[i] >= 1 && len[i] <= width, name, ": row ", i, " has length ", len[i], " (slots hold ", width, ")");
  Runs rt;
  std::vector<int64_t> bound;  // tokens of each source (the pool's first)
  bound.push_back(slots_n);
  if (ra != nullptr) {  // runs of keys of other sources or read with the queries rotated
    rt = checked_runs(ra, b, sl, width, len, heads, d, k, bound, name);
  } else {
    for (int64_t i = 0; i < b; ++i)
      for (int64_t j = 0; j < len[i]; ++j)
        TORCH_CHECK(sl[i * width + j] >= 0 && sl[i * width + j] < slots_n, name, ": row ", i, " slot ",
                    sl[i * width + j], " is outside the ", slots_n, " slots of k and v");
  }
  const auto f32 = q.options().dtype(at::kFloat);
  at::Tensor out = at::empty({heads, b, g, d}, f32);
  at::Tensor lse = at::empty({heads, b, g}, f32);
  if (heads == 0 || b == 0 || g == 0) return {out, lse};
  by_kv_type(k, v, [&](auto* kp, auto* vp) {
    using KV = std::remove_const_t<std::remove_pointer_t<decltype(kp)>>;
    const std::vector<Source<KV>> src = ra != nullptr ? sources_of(kp, vp, k, v, slots_n, ra->sources, ra->layer)
                                                      : sources_of(kp, vp, k, v, slots_n, at::TensorList(), 0);
    auto go = [&](auto* qp) {
      by_head_dim(d, [&](auto nd) {
        run_gather<decltype(nd)::value>(qp, src, sl, width, len, heads, b, g, static_cast<float>(scale),
                                        out.data_ptr<float>(), lse.data_ptr<float>(), rt);
      });
    };
    if constexpr (kDot && std::is_same_v<KV, uint16_t>) {
      if (dot) return go(reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()));
    }
    go(static_cast<const float*>(q.data_ptr<float>()));
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> attend_gather(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 const at::Tensor& slots, const at::Tensor& lengths, double scale) {
  return gather_checked(q, k, v, slots, lengths, scale, "promptcache_native.attend_gather", nullptr);
}

// attend_gather over runs of each row's keys (Runs): documents read in place (a store's states or
// the pool's) at any position, every decode row's keys in one call.
std::tuple<at::Tensor, at::Tensor> attend_gather_runs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                      const at::Tensor& slots, const at::Tensor& lengths, double scale,
                                                      const at::Tensor& run_starts, const at::Tensor& run_src,
                                                      const at::Tensor& run_rot, const at::Tensor& cos,
                                                      const at::Tensor& sin, at::TensorList sources, int64_t layer) {
  const RunArgs ra{&run_starts, &run_src, &run_rot, &cos, &sin, sources, layer};
  return gather_checked(q, k, v, slots, lengths, scale, "promptcache_native.attend_gather_runs", &ra);
}

// Prefill rows over runs of their keys (run_prefill): the step's prefill queries q [X, G, M, D] (M
// queries, G query heads of each KV head), query qi of row query_row[qi] seeing the first
// limits[qi, i] keys of the row's run i (int64 [M, R], 0 .. the run's keys); rows, runs, sources
// and rotations as attend_gather_runs's. Returns out [X, G, M, D], lse [X, G, M] (float32; a query
// that sees no key: 0 and -inf). bfloat16 queries over a bfloat16 pool take bfloat16 products where
// the CPU has AVX-512 BF16 (run_prefill); any other bfloat16 queries are widened (exact), products
// and sums float32.
std::tuple<at::Tensor, at::Tensor> attend_prefill_runs(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v,
                                                       const at::Tensor& slots, const at::Tensor& lengths, double scale,
                                                       const at::Tensor& run_starts, const at::Tensor& run_src,
                                                       const at::Tensor& run_rot, const at::Tensor& cos,
                                                       const at::Tensor& sin, at::TensorList sources, int64_t layer,
                                                       const at::Tensor& query_row, const at::Tensor& limits) {
  const char* name = "promptcache_native.attend_prefill_runs";
  TORCH_CHECK(q_in.dim() == 4 && k.dim() == 3 && v.dim() == 3, name, ": q must be [X, G, M, D], k and v [X, S, D]");
  check_common(q_in, k, v, name);
  const bool dot = kDot && q_in.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16;
  const at::Tensor q = (dot ? q_in : q_in.to(at::kFloat)).contiguous();
  const int64_t heads = q.size(0), g = q.size(1), m = q.size(2), d = q.size(3), slots_n = k.size(1);
  TORCH_CHECK(k.size(0) == heads && v.size(0) == heads && v.size(1) == slots_n && k.size(2) == d && v.size(2) == d,
              name, ": q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes(), " do not match");
  TORCH_CHECK(slots.device().is_cpu() && lengths.device().is_cpu() && slots.scalar_type() == at::kLong &&
                  lengths.scalar_type() == at::kLong && slots.dim() == 2 && slots.is_contiguous() &&
                  lengths.dim() == 1 && lengths.size(0) == slots.size(0) && lengths.is_contiguous(),
              name, ": slots must be int64 [B, W] and lengths int64 [B]; got ", slots.scalar_type(), " ",
              slots.sizes(), " and ", lengths.scalar_type(), " ", lengths.sizes());
  const int64_t b = slots.size(0), width = slots.size(1);
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t* len = lengths.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i)
    TORCH_CHECK(len[i] >= 0 && len[i] <= width, name, ": row ", i, " has length ", len[i], " (slots hold ", width, ")");
  std::vector<int64_t> bound{slots_n};
  const RunArgs ra{&run_starts, &run_src, &run_rot, &cos, &sin, sources, layer};
  const Runs rt = checked_runs(&ra, b, sl, width, len, heads, d, k, bound, name);
  const int64_t runs_n = rt.width;
  TORCH_CHECK(query_row.device().is_cpu() && query_row.scalar_type() == at::kLong && query_row.dim() == 1 &&
                  query_row.size(0) == m && query_row.is_contiguous(),
              name, ": query_row must be contiguous int64 [M], M = ", m, "; got ", query_row.scalar_type(), " ",
              query_row.sizes());
  TORCH_CHECK(limits.device().is_cpu() && limits.scalar_type() == at::kLong && limits.dim() == 2 && limits.size(0) == m &&
                  limits.size(1) == runs_n && limits.is_contiguous(),
              name, ": limits must be contiguous int64 [M, R] = [", m, ", ", runs_n, "]; got ", limits.scalar_type(), " ",
              limits.sizes());
  const int64_t* qrow = query_row.data_ptr<int64_t>();
  const int64_t* lim = limits.data_ptr<int64_t>();
  for (int64_t i = 0; i < m; ++i) {
    TORCH_CHECK(qrow[i] >= 0 && qrow[i] < b, name, ": query ", i, " is of row ", qrow[i], " (", b, " rows)");
    const int64_t* st = rt.starts + qrow[i] * runs_n;
    for (int64_t j = 0; j < runs_n; ++j) {
      const int64_t keys = (j + 1 < runs_n ? st[j + 1] : len[qrow[i]]) - st[j];
      TORCH_CHECK(lim[i * runs_n + j] >= 0 && lim[i * runs_n + j] <= keys, name, ": query ", i, " sees ",
                  lim[i * runs_n + j], " keys of run ", j, " of row ", qrow[i], " (it holds ", keys, ")");
    }
  }
  const auto f32 = q.options().dtype(at::kFloat);
  at::Tensor out = at::empty({heads, g, m, d}, f32);
  at::Tensor lse = at::empty({heads, g, m}, f32);
  if (heads == 0 || g == 0 || m == 0) return {out, lse};
  by_kv_type(k, v, [&](auto* kp, auto* vp) {
    using KV = std::remove_const_t<std::remove_pointer_t<decltype(kp)>>;
    const std::vector<Source<KV>> src = sources_of(kp, vp, k, v, slots_n, sources, layer);
    by_head_dim(d, [&](auto nd) {
      constexpr int ND = decltype(nd)::value;
      if constexpr (std::is_same_v<KV, uint16_t>) {
        if (dot) {
          run_prefill<ND>(reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()), src, sl, width, len, heads,
                          g, m, qrow, lim, static_cast<float>(scale), out.data_ptr<float>(), lse.data_ptr<float>(), rt);
          return;
        }
      }
      run_prefill<ND>(q.data_ptr<float>(), src, sl, width, len, heads, g, m, qrow, lim, static_cast<float>(scale),
                      out.data_ptr<float>(), lse.data_ptr<float>(), rt);
    });
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> attend_checked(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v,
                                                  double scale, int64_t causal_t, const int64_t* limits) {
  const int64_t heads = q_in.size(0), m = q_in.size(1), d = q_in.size(2), n = k.size(1);
  // bfloat16 queries over a bfloat16 pool: bfloat16 products where the CPU has them; anything else
  // with float32 queries (a bfloat16 query widened is exact)
  const bool dot = kDot && q_in.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16;
  const at::Tensor q = dot || q_in.scalar_type() == at::kFloat ? q_in : q_in.to(at::kFloat);
  const auto f32 = q.options().dtype(at::kFloat);
  at::Tensor out = at::empty({heads, m, d}, f32);
  at::Tensor lse = at::empty({heads, m}, f32);
  if (heads == 0 || m == 0) return {out, lse};
  if (n == 0) {  // no keys: nothing to attend (a log-sum-exp of -inf, weight 0 in a merge)
    out.zero_();
    lse.fill_(-std::numeric_limits<float>::infinity());
    return {out, lse};
  }
  const int64_t tiles = heads * ((n + kKeys - 1) / kKeys);
  by_kv_type(k, v, [&](auto* kp, auto* vp) {
    using KV = std::remove_const_t<std::remove_pointer_t<decltype(kp)>>;
    auto go = [&](auto* qp, const at::Tensor& packed) {
      using Q = std::remove_const_t<std::remove_pointer_t<decltype(qp)>>;
      Args<KV, Q> a{qp, kp, vp, packed.data_ptr(), out.data_ptr<float>(), lse.data_ptr<float>(),
                    q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), m, n, causal_t,
                    static_cast<float>(scale), limits};
      by_head_dim(d, [&](auto nd) { run<decltype(nd)::value>(a, heads); });
    };
    if constexpr (std::is_same_v<KV, uint16_t>) {
      if (dot) {
        go(reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()),
           at::empty({tiles * packed_per_tile<uint16_t>(d)}, q.options().dtype(at::kBFloat16)));
        return;
      }
    }
    go(static_cast<const float*>(q.data_ptr<float>()), at::empty({tiles * packed_per_tile<float>(d)}, f32));
  });
  return {out, lse};
}

void check_attend_shapes(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v, const char* name) {
  TORCH_CHECK(q_in.dim() == 3 && k.dim() == 3 && v.dim() == 3, name, ": q, k, v must be [X, rows, D]");
  check_common(q_in, k, v, name);
  const int64_t heads = q_in.size(0), n = k.size(1), d = q_in.size(2);
  TORCH_CHECK(k.size(0) == heads && v.size(0) == heads && v.size(1) == n && k.size(2) == d && v.size(2) == d,
              name, ": q ", q_in.sizes(), ", k ", k.sizes(), ", v ", v.sizes(), " do not match");
}

std::tuple<at::Tensor, at::Tensor> attend(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v,
                                          double scale, int64_t causal_t) {
  const char* name = "promptcache_native.attend";
  check_attend_shapes(q_in, k, v, name);
  const int64_t m = q_in.size(1), n = k.size(1);
  TORCH_CHECK(causal_t >= 0 && (causal_t == 0 || (m % causal_t == 0 && n == causal_t)),
              name, ": causal_t ", causal_t, " needs rows a multiple of it and as many keys");
  return attend_checked(q_in, k, v, scale, causal_t, nullptr);
}

// Queries that each see a prefix of the keys: row r (of every head) sees keys 0 .. limits[r] - 1.
// A masked forward whose mask is a prefix per query (selective recompute's causal-by-prompt-order
// mask over a buffer in prompt order) costs the keys each query sees, not all of them: key tiles
// past a query tile's longest prefix are never read (rows in prompt order: a tile's prefixes are alike).
std::tuple<at::Tensor, at::Tensor> attend_limits(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v,
                                                 double scale, const at::Tensor& limits) {
  const char* name = "promptcache_native.attend_limits";
  check_attend_shapes(q_in, k, v, name);
  const int64_t m = q_in.size(1), n = k.size(1);
  TORCH_CHECK(limits.device().is_cpu() && limits.scalar_type() == at::kLong && limits.dim() == 1 && limits.size(0) == m,
              name, ": limits must be int64 [", m, "] (one per query row), got ", limits.scalar_type(), " ", limits.sizes());
  const at::Tensor lim = limits.contiguous();
  const int64_t* lp = lim.data_ptr<int64_t>();
  int64_t top = 0;  // keys past every row's prefix are not even packed
  for (int64_t i = 0; i < m; ++i) {
    TORCH_CHECK(lp[i] >= 1 && lp[i] <= n, name, ": row ", i, " sees ", lp[i], " keys (of ", n, "; at least 1)");
    top = std::max(top, lp[i]);
  }
  return attend_checked(q_in, k.narrow(1, 0, top), v.narrow(1, 0, top), scale, 0, lp);
}

}  // namespace

TORCH_LIBRARY(promptcache_native, m) {
  m.def("attend(Tensor q, Tensor k, Tensor v, float scale, int causal_t) -> (Tensor, Tensor)");
  m.def("attend_gather(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor lengths, float scale) -> (Tensor, Tensor)");
  m.def("attend_limits(Tensor q, Tensor k, Tensor v, float scale, Tensor limits) -> (Tensor, Tensor)");
  m.def("attend_gather_runs(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor lengths, float scale, Tensor run_starts, "
        "Tensor run_src, Tensor run_rot, Tensor cos, Tensor sin, Tensor[] sources, int layer) -> (Tensor, Tensor)");
  m.def("attend_prefill_runs(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor lengths, float scale, Tensor run_starts, "
        "Tensor run_src, Tensor run_rot, Tensor cos, Tensor sin, Tensor[] sources, int layer, Tensor query_row, "
        "Tensor limits) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(promptcache_native, CPU, m) {
  m.impl("attend", &attend);
  m.impl("attend_gather", &attend_gather);
  m.impl("attend_limits", &attend_limits);
  m.impl("attend_gather_runs", &attend_gather_runs);
  m.impl("attend_prefill_runs", &attend_prefill_runs);
}

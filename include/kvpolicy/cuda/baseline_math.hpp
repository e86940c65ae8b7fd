// Per-element math of the CUDA baseline scorers and of the device Ada-KV allocator
// (cuda/baselines.cu), as KVP_HD functions in a header free of CUDA and Eigen, so the CPU tests
// drive exactly this logic in a host emulation of the kernels' grids
// (tests/agreement/test_baselines_cuda.cpp).
//
// KNorm / KeyDiff: one warp per token. Lane `lane` folds the dims lane, lane + 32, ... of the
// token's key into a partial; the 32 partials are combined by the butterfly (xor 16, 8, 4, 2, 1)
// the kernels do with shuffles, so every lane ends with the same value (warp_tree_sum emulates
// it on the host, in the same pairing).
// KeyDiff's anchor (mean over the head's tokens of k / ||k||, double) is summed per chunk of
// kAnchorChunk tokens (one partial per chunk and dim), then the chunks are added in order.
//
// Ada-KV: per layer, each head's non-protected tokens are sorted descending by topk_key; head h
// keeps g_h = keep_h - P of them first (keep_h = its safeguard), the rest of its sorted row is
// its pool. The layer's `free` = sum_h (B_h - keep_h) tokens go to the highest pool entries in
// the order (key, head) descending. A radix select on the 64-bit key finds t* = the largest key
// value with pool_count(t*) >= free (8 rounds of 8-bit digits, each digit's count a sum over
// heads of a binary search in the sorted rows); heads with a pool key > t* take those, and the
// entries equal to t* (at most one per head: keys carry the token index) go to the highest heads.
#pragma once
#include <cmath>
#include <cstdint>

#include "kvpolicy/core/config.hpp"
#include "kvpolicy/core/topk_key.hpp"

namespace kvpolicy::cuda::baseline {

inline constexpr int kWarp = 32;
inline constexpr std::int64_t kAnchorChunk = 256;  // KeyDiff: tokens per anchor partial

// ---- warp reductions -------------------------------------------------------------------------

// Host emulation of the kernels' xor butterfly: p[i] <- p[i] + p[i ^ off] for off = 16 .. 1.
// Returns lane 0's value (all lanes end equal: fp addition is commutative).
template <class V>
KVP_HD inline V warp_tree_sum(V* p) {
  for (int off = kWarp / 2; off >= 1; off /= 2) {
    V n[kWarp];
    for (int i = 0; i < kWarp; ++i) n[i] = p[i] + p[i ^ off];
    for (int i = 0; i < kWarp; ++i) p[i] = n[i];
  }
  return p[0];
}

// ---- KNorm ------------------------------------------------------------------------------------

// Lane partial of ||k||^2 in fp32: fmaf over the dims lane, lane + 32, ... in order.
// `get(i)` returns element i of the token's key as float.
template <class Get>
KVP_HD inline float knorm_lane(const Get& get, int lane, std::int64_t d) {
  float s = 0.f;
  for (std::int64_t i = lane; i < d; i += kWarp) {
    const float x = get(i);
    s = fmaf(x, x, s);
  }
  return s;
}
KVP_HD inline float knorm_finish(float sum_sq) { return -sqrtf(sum_sq); }

// ---- KeyDiff ----------------------------------------------------------------------------------

template <class Get>
KVP_HD inline double sumsq_lane(const Get& get, int lane, std::int64_t d) {
  double s = 0;
  for (std::int64_t i = lane; i < d; i += kWarp) {
    const double x = get(i);
    s += x * x;
  }
  return s;
}

// Lane partial of k . anchor (double).
template <class Get>
KVP_HD inline double anchor_dot_lane(const Get& get, const double* anchor, int lane,
                                     std::int64_t d) {
  double s = 0;
  for (std::int64_t i = lane; i < d; i += kWarp) s += static_cast<double>(get(i)) * anchor[i];
  return s;
}

KVP_HD inline std::int64_t anchor_chunks(std::int64_t T) {
  return (T + kAnchorChunk - 1) / kAnchorChunk;
}

// One dim's contribution of a token to the anchor sum: x / ||k|| (0 for a zero key).
KVP_HD inline double anchor_term(float x, double norm) {
  return norm > 0 ? static_cast<double>(x) / norm : 0.0;
}

// KeyDiff's score from the key's norm (as the CPU stores it: fp32), its dot with the anchor and
// the anchor's norm: -cos, 0 for a zero key or anchor.
KVP_HD inline float keydiff_score(float norm, double dot, double anchor_norm) {
  const double n = norm;
  return (n > 0 && anchor_norm > 0) ? static_cast<float>(-dot / (n * anchor_norm)) : 0.f;
}

// ---- TOVA / StreamingLLM ----------------------------------------------------------------------

// TOVA's score of token j: mean over the layer's KV heads of the GQA-mean window attention of
// the last query, summed in head order. `a` points at (l, 0, j); rows are `stride` floats apart.
KVP_HD inline float tova_at(const float* a, std::int64_t heads, std::int64_t stride) {
  float s = 0;
  for (std::int64_t h = 0; h < heads; ++h) s += a[h * stride];
  return s / static_cast<float>(heads);
}

KVP_HD inline float streaming_at(std::int64_t j) { return static_cast<float>(j); }

// ---- Ada-KV -----------------------------------------------------------------------------------

// Protected tokens of a T-token row as AdaKV::allocate counts them: [0, sinks) and
// [recent_begin, T); the scored tokens are [sinks, recent_begin).
struct AdaSpan {
  std::int64_t sinks, recent_begin;
  KVP_HD std::int64_t protected_count(std::int64_t T) const { return sinks + (T - recent_begin); }
  KVP_HD std::int64_t scored() const { return recent_begin - sinks; }
};
KVP_HD inline AdaSpan ada_span(std::int64_t sinks, std::int64_t recent, std::int64_t T) {
  const std::int64_t s = sinks < 0 ? 0 : (sinks > T ? T : sinks);
  const std::int64_t r = recent < 0 ? 0 : recent;
  const std::int64_t rb = T - r;
  return {s, rb > s ? rb : s};
}

// Budget of a row clamped to what AdaKV::allocate accepts ([P, T]; the typed wrapper checks
// host budgets, device budgets cannot be checked without a copy).
KVP_HD inline std::int64_t ada_clamp(std::int64_t b, std::int64_t P, std::int64_t T) {
  return b < P ? P : (b > T ? T : b);
}

// AdaKV::safeguard: min(b, max(P, floor(alpha b))).
KVP_HD inline std::int64_t ada_keep(std::int64_t b, std::int64_t P, double alpha) {
  const auto s = static_cast<std::int64_t>(floor(alpha * static_cast<double>(b)));
  const std::int64_t m = P > s ? P : s;
  return b < m ? b : m;
}

// Number of entries >= t in a row of n keys sorted descending (binary search).
KVP_HD inline std::int64_t count_ge(const std::uint64_t* row, std::int64_t n, std::uint64_t t) {
  std::int64_t lo = 0, hi = n;  // row[0, lo) >= t, row[hi, n) < t
  while (lo < hi) {
    const std::int64_t mid = lo + (hi - lo) / 2;
    if (row[mid] >= t) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

// Pool entries (positions >= g of the sorted row) with key >= t.
KVP_HD inline std::int64_t pool_ge(const std::uint64_t* row, std::int64_t n, std::int64_t g,
                                   std::uint64_t t) {
  const std::int64_t c = count_ge(row, n, t) - g;
  return c > 0 ? c : 0;
}

inline constexpr int kDigitBits = 8;
inline constexpr int kDigits = 1 << kDigitBits;
inline constexpr int kRounds = 64 / kDigitBits;

KVP_HD inline int round_shift(int r) { return 64 - kDigitBits * (r + 1); }
KVP_HD inline std::uint64_t candidate(std::uint64_t prefix, int r, int digit) {
  return prefix | (static_cast<std::uint64_t>(digit) << round_shift(r));
}
// The digit a radix-select round keeps: the largest d with count[d] >= need (count is
// non-increasing in d and count[0] >= need by the invariant). Exactly one d answers true.
template <class C>
KVP_HD inline bool digit_wins(const C* count, int d, std::int64_t need) {
  return static_cast<std::int64_t>(count[d]) >= need &&
         (d == kDigits - 1 || static_cast<std::int64_t>(count[d + 1]) < need);
}

// Final budgets of a layer from the selected key t*: head h has gt[h] pool entries above t* and
// eq[h] (0 or 1) equal to it; the free - sum(gt) entries equal to t* go to the highest heads.
KVP_HD inline void ada_assign(const std::int64_t* keep, const std::int64_t* gt,
                              const std::int64_t* eq, std::int64_t H, std::int64_t free,
                              std::int64_t* out) {
  std::int64_t need = free;
  for (std::int64_t h = 0; h < H; ++h) need -= gt[h];
  for (std::int64_t h = H - 1; h >= 0; --h) {
    const std::int64_t t = (eq[h] > 0 && need > 0) ? 1 : 0;
    need -= t;
    out[h] = keep[h] + gt[h] + t;
  }
}

}  // namespace kvpolicy::cuda::baseline

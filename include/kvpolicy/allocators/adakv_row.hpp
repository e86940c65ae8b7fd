// Per-thread math of Ada-KV shared by the CPU and the CUDA kernels: KVP_HD functions free of
// CUDA and Eigen, beside the stage's header, so that the host emulation of the kernels' grids
// (tests/agreement/) drives exactly the logic the device runs. Kernels: cuda/baselines.cu. Per layer,
// each head's non-protected tokens are sorted descending by topk_key; head h keeps g_h = keep_h - P
// of them first (keep_h = its safeguard), the rest of its sorted row is its pool. The layer's
// `free` = sum_h (B_h - keep_h) tokens go to the highest pool entries in the order (key, head)
// descending. A radix select on the 64-bit key finds t* = the largest key value with
// pool_count(t*) >= free (8 rounds of 8-bit digits, each digit's count a sum over heads of a
// binary search in the sorted rows); heads with a pool key > t* take those, and the entries equal
// to t* (at most one per head: keys carry the token index) go to the highest heads.

#pragma once
#include <cmath>
#include <cstdint>

#include "kvpolicy/core/config.hpp"

namespace kvpolicy::row_math {

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

}  // namespace kvpolicy::row_math

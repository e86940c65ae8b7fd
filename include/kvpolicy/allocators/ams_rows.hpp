// AMS per row as KVP_HD functions on raw arrays (the pooling is row_math's), the per-row logic of the CUDA kernels (cuda/ams.cu,
// one thread block per (layer, KV head) row) and of the CPU allocator alike:
//  - steps 1-2 (the mass): per-token phases with sums in kMassLanes fixed lanes, which the CPU
//    (ams::current_mass, ams::update_credit) runs as loops and the kernel as one thread per lane,
//    so that the mass is bitwise the same;
//  - step 5 (candidates): the k-th largest library order key of a segment by a bitwise search
//    over counts (kth_key), and the score mask (mask_score).
// Steps 3-4 (cuts, split/merge, quotas) below are
// the same arithmetic as ams::segments / ams::quotas in allocators/ams.hpp operation for
// operation (same summation order, same lower_bound, same rounding), so integers agree exactly.
// The candidates' bitwise search is checked against ams::mark_candidates' nth_element.
// tests/agreement/test_ams_rows.cpp checks that against the CPU allocator's functions.
// Free of CUDA and Eigen; the pooling is row_math::pool_at (scorers/snapkv_row.hpp), the order
// keys core/topk_key.hpp.
#pragma once
#include <cfloat>
#include <cmath>
#include <cstdint>

#include "kvpolicy/core/config.hpp"
#include "kvpolicy/core/topk_key.hpp"
#include "kvpolicy/scorers/snapkv_row.hpp"

namespace kvpolicy::ams::rows {

// relu + 1e-12, then divided by the sum, in place (ams::normalize).
KVP_HD inline void normalize(double* x, std::int64_t n) {
  double s = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    x[i] = (x[i] > 0.0 ? x[i] : 0.0) + 1e-12;
    s += x[i];
  }
  for (std::int64_t i = 0; i < n; ++i) x[i] /= s;
}

// cum[i] = mass[0] + ... + mass[i], left to right (std::partial_sum).
KVP_HD inline void prefix_sum(const double* mass, std::int64_t n, double* cum) {
  double s = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    s = i == 0 ? mass[0] : s + mass[i];
    cum[i] = s;
  }
}

// First i with cum[i] >= target (n if none): std::lower_bound.
KVP_HD inline std::int64_t lower_bound(const double* cum, std::int64_t n, double target) {
  std::int64_t lo = 0, len = n;
  while (len > 0) {
    const std::int64_t half = len / 2;
    if (cum[lo + half] < target) {
      lo += half + 1;
      len -= half + 1;
    } else {
      len = half;
    }
  }
  return lo;
}

// Cut positions: cuts[0] = 0, ..., cuts[k - 1] = n (n >= 1); returns k <= n + 1. `cuts` holds
// n + 1 entries.
KVP_HD inline std::int64_t cuts(const double* cum, std::int64_t n, double segment_mass,
                                std::int64_t* out) {
  std::int64_t k_out = 0;
  out[k_out++] = 0;
  for (double k = 1;;) {
    const double target = k * segment_mass;
    if (target >= 1.0 - 1e-12) break;
    const std::int64_t idx = lower_bound(cum, n, target);
    const std::int64_t hi = n - 1 > 1 ? n - 1 : 1;
    const std::int64_t c = idx < 1 ? 1 : (idx > hi ? hi : idx);
    if (c > out[k_out - 1] && c < n) out[k_out++] = c;
    if (idx >= n) break;
    const double next = std::floor(cum[idx] / segment_mass);
    k = k + 1 > next ? k + 1 : next;
  }
  out[k_out++] = n;
  return k_out;
}

// Segments [begin[i], end[i]) from the cuts: pieces longer than max_len split, then pieces
// shorter than min_len merged with the following ones. begin/end hold n entries; returns the
// count. The split pass writes first, the merge compacts in place (write index <= read index).
KVP_HD inline std::int64_t split_merge(const std::int64_t* cut, std::int64_t ncuts,
                                       std::int64_t min_len, std::int64_t max_len,
                                       std::int64_t* begin, std::int64_t* end) {
  std::int64_t m = 0;
  for (std::int64_t i = 0; i + 1 < ncuts; ++i) {
    std::int64_t s = cut[i];
    const std::int64_t e = cut[i + 1];
    for (; e - s > max_len; s += max_len) begin[m] = s, end[m++] = s + max_len;
    if (e > s) begin[m] = s, end[m++] = e;
  }
  std::int64_t out = 0;
  for (std::int64_t i = 0; i < m; ++i) {
    const std::int64_t b = begin[i];
    std::int64_t e = end[i];
    while (e - b < min_len && i + 1 < m) e = end[++i];
    begin[out] = b, end[out++] = e;
  }
  return out;
}

// Segment masses: sum of mass over each segment, left to right (std::accumulate from 0.0).
KVP_HD inline double segment_mass(const double* mass, std::int64_t b, std::int64_t e) {
  double s = 0.0;
  for (std::int64_t j = b; j < e; ++j) s += mass[j];
  return s;
}

// Round-robin passes in index order moving q[i] by dir (bounded by lim[i]: q > lim for -1,
// q < lim for +1) until sum == target or nothing can move (ams::detail::round_robin).
KVP_HD inline void round_robin(std::int64_t* q, const std::int64_t* lim, std::int64_t lim_const,
                               std::int64_t n, std::int64_t& sum, std::int64_t target, int dir) {
  auto eligible = [&](std::int64_t i) {
    const std::int64_t l = lim ? lim[i] : lim_const;
    return dir < 0 ? q[i] > l : q[i] < l;
  };
  bool any = true;
  while (sum != target && any) {
    any = false;
    for (std::int64_t i = 0; i < n; ++i) {
      if (sum != target && eligible(i)) {
        q[i] += dir;
        sum += dir;
      }
      any = any || eligible(i);
    }
  }
}

// Quotas summing to exactly `budget` (ams::quotas). len[i] = segment sizes; base is scratch
// (n entries). Returns false when budget is outside [0, sum of len] (q untouched then).
KVP_HD inline bool quotas(const std::int64_t* len, const double* seg_mass, std::int64_t n,
                          std::int64_t budget, std::int64_t min_keep, std::int64_t* q,
                          std::int64_t* base) {
  std::int64_t sum = 0, total_len = 0;
  for (std::int64_t i = 0; i < n; ++i) total_len += len[i];
  if (budget < 0 || budget > total_len) return false;
  for (std::int64_t i = 0; i < n; ++i) {
    base[i] = q[i] = len[i] < min_keep ? len[i] : min_keep;
    sum += q[i];
  }
  if (sum >= budget) {
    round_robin(q, nullptr, 1, n, sum, budget, -1);
    round_robin(q, nullptr, 0, n, sum, budget, -1);
    return true;
  }
  const std::int64_t remain = budget - sum;
  double total_mass = 0.0;
  for (std::int64_t i = 0; i < n; ++i) total_mass += seg_mass[i];
  total_mass += 1e-12;
  sum = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const auto add = static_cast<std::int64_t>(
        std::nearbyint(static_cast<double>(remain) * (seg_mass[i] / total_mass)));
    q[i] = len[i] < base[i] + add ? len[i] : base[i] + add;
    sum += q[i];
  }
  round_robin(q, base, 0, n, sum, budget, -1);
  round_robin(q, len, 0, n, sum, budget, +1);
  return true;
}

}  // namespace kvpolicy::ams::rows

namespace kvpolicy::ams::rows {

// Parameters of steps 3-4 (AMS's fields).
struct Params {
  double segment_mass = 0.02;
  std::int64_t min_seg_len = 32, max_seg_len = 1024, min_keep = 8;
};

// Scratch and output of one row of n = end - begin unprotected tokens; every array holds at
// least n + 1 entries.
struct RowBuffers {
  double* mid;           // the renormalized mass of [begin, end)
  double* cum;           // its prefix sums
  double* seg_mass;      // per segment
  std::int64_t* cut;     // cut positions (then reused: nothing)
  std::int64_t* seg_begin;  // segments, in row positions (begin added) once the row is done
  std::int64_t* seg_end;
  std::int64_t* quota;
  std::int64_t* base;    // scratch of quotas()
};

// Phase 1 (one thread): mid = normalize(m[begin, end)), cuts, split/merge; returns the segment
// count (segments relative to begin).
KVP_HD inline std::int64_t row_segments(const double* m, std::int64_t begin, std::int64_t end,
                                        const Params& p, const RowBuffers& b) {
  const std::int64_t n = end - begin;
  if (n <= 0) return 0;
  for (std::int64_t i = 0; i < n; ++i) b.mid[i] = m[begin + i];
  normalize(b.mid, n);
  prefix_sum(b.mid, n, b.cum);
  const std::int64_t nc = cuts(b.cum, n, p.segment_mass, b.cut);
  return split_merge(b.cut, nc, p.min_seg_len, p.max_seg_len, b.seg_begin, b.seg_end);
}

// Phase 2 (segment i, any thread): its mass.
KVP_HD inline void row_segment_mass(const RowBuffers& b, std::int64_t i) {
  b.seg_mass[i] = segment_mass(b.mid, b.seg_begin[i], b.seg_end[i]);
}

// Phase 3 (one thread): quotas; false if budget is outside [0, n]. Uses `cut` for the lengths.
KVP_HD inline bool row_quotas(std::int64_t nseg, std::int64_t budget, const Params& p,
                              const RowBuffers& b) {
  for (std::int64_t i = 0; i < nseg; ++i) b.cut[i] = b.seg_end[i] - b.seg_begin[i];
  return quotas(b.cut, b.seg_mass, nseg, budget, p.min_keep, b.quota, b.base);
}

// Phase 4 (segment i, any thread): shift to row positions.
KVP_HD inline void row_shift(const RowBuffers& b, std::int64_t i, std::int64_t begin) {
  b.seg_begin[i] += begin;
  b.seg_end[i] += begin;
}

}  // namespace kvpolicy::ams::rows

namespace kvpolicy::ams::rows {

// ---- Steps 1-2: the mass of one row, as per-token phases ---------------------------------------
// Sums over a row's tokens run in kMassLanes lanes: lane l adds tokens l, l + kMassLanes, ... in
// order, then the lane sums are added in lane order (lanes_total). The products that meet a sum
// are written as fma, so that compilers cannot contract them differently on host and device.
// Phases for a row of T tokens whose first `pooled` = T - min(w, T) precede the window:
//   A (j < pooled):  m_cur[j] = mass_pooled(j), whose maximum mx the window's tokens take;
//   B (every j):     m_cur[j] = mass_current(m_cur[j], j, mx);            S1 = lane sums
//   C (every j):     m_cur[j] /= S1; c[j] = mass_credit(m_cur[j], credit[j]); S2 = lane sums
//   D (every j):     out[j] = mass_mix(m_cur[j], c[j], S2);                 S3 = lane sums
//   E (every j):     out[j] /= S3.
// (c and out may be the same array: D reads c[j] before it writes out[j].)
inline constexpr int kMassLanes = 256;

KVP_HD inline double relu_eps(double v) { return (v > 0.0 ? v : 0.0) + 1e-12; }

// Lane `lane`'s part of the sum of x[0..n).
KVP_HD inline double lane_sum(const double* x, std::int64_t n, int lane) {
  double s = 0.0;
  for (std::int64_t j = lane; j < n; j += kMassLanes) s += x[j];
  return s;
}

// The lanes' sums added in lane order.
KVP_HD inline double lanes_total(const double* lanes) {
  double s = 0.0;
  for (int l = 0; l < kMassLanes; ++l) s += lanes[l];
  return s;
}

// Phase A: token j's average-pooled window attention (j < pooled; padding counted).
KVP_HD inline float mass_pooled(const float* attn, std::int64_t pooled, std::int64_t j,
                                int kernel) {
  return row_math::pool_at(attn, pooled, j, kernel, Pool::avg);
}

// Phase B: token j's current mass before normalizing from its phase A value `p` (read for
// j < pooled only): uniform when no token precedes the window.
KVP_HD inline double mass_current(float p, std::int64_t pooled, std::int64_t j, float mx) {
  if (pooled == 0) return relu_eps(1.0);
  return relu_eps(j < pooled ? p : mx);
}

// Phase C: the credit after this event, lambda credit_prev + (1 - lambda) m_cur (stored in fp32),
// from the normalized m_cur; returns it as the unnormalized c.
KVP_HD inline float credit_next(float credit_prev, double m_cur, double lambda) {
  return static_cast<float>(fma(lambda, static_cast<double>(credit_prev), (1.0 - lambda) * m_cur));
}

// Phase D: beta m_cur + (1 - beta) c / S2, before normalizing.
KVP_HD inline double mass_mix(double m_cur, double c, double s2, double beta) {
  return relu_eps(fma(beta, m_cur, (1.0 - beta) * (c / s2)));
}

// ---- Step 5: a segment's candidates -------------------------------------------------------------
// The largest key t with at least k keys >= t, i.e. the k-th largest of distinct keys (library
// order keys are distinct: topk_key packs the index), for 1 <= k <= count. count_ge(t) returns
// how many keys are >= t; on the device it is a block-wide count that every thread calls.
template <class CountGe>
KVP_HD inline std::uint64_t kth_key(std::int64_t k, CountGe&& count_ge) {
  std::uint64_t t = 0;
  for (int bit = 63; bit >= 0; --bit) {
    const std::uint64_t trial = t | (std::uint64_t{1} << bit);
    if (count_ge(trial) >= k) t = trial;
  }
  return t;
}

// The score an unprotected token leaves for the per-row top-k: -inf for a non-candidate, the
// lowest finite float for a candidate scored -inf (so that the top-k takes exactly the candidates).
KVP_HD inline float mask_score(float s, bool candidate) {
  if (!candidate) return -INFINITY;
  return s == -INFINITY ? -FLT_MAX : s;
}

}  // namespace kvpolicy::ams::rows

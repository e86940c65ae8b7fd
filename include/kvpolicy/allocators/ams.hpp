// AMS, Adaptive Mass-Segmented quotas (Yang & Shen 2026; code: EIT-NLP/AdaptiveMassSegment):
// wraps any scorer and stops a global top-k from emptying whole contiguous regions. Per row
// (layer, KV head) with budget B, see shared/algorithms.md:
//  1. mass m_cur: window attention of the last `window` queries (GQA mean), avg-pooled with
//     `kernel` over the tokens before the window; the window's tokens get the row's maximum;
//     normalized (relu, + 1e-12, divided by the sum).
//  2. credit = lambda credit_prev + (1 - lambda) m_cur (per token, new tokens start at 0);
//     m = normalize(beta m_cur + (1 - beta) normalize(credit)).
//  3. cuts where the cumulative mass first reaches k * segment_mass (k = 1, 2, ... below 1):
//     the token that crosses starts the next segment; cuts clamped to [1, n-1] and deduplicated;
//     segments longer than max_seg_len split into max_seg_len pieces, then segments shorter than
//     min_seg_len merged with the following ones (the last segment may stay short).
//  4. quota_i = min(len_i, min_keep) + round((budget - sum min) mass_i / sum mass) capped at
//     len_i, then +-1 round-robin (segment 0 first, removing only above the minimum, adding only
//     below the length) until the quotas sum to exactly the budget.
//  5. candidates: the wrapped scorer's top quota_i tokens inside each segment.
//  6. kept: the protected tokens (the scorer's, `sinks` first and `keep_last` newest) plus the
//     candidates, sorted.
// Choices the sources leave open or where this differs from the authors' code:
// - Protected tokens are kept outright and take their share of B first: steps 3-5 run over the
//   unprotected tokens only, with their mass renormalized and budget B - protected, so the
//   candidates are exactly the tokens kept besides the protected ones. (Segmenting the whole row
//   and then filling "the rest of B with the best candidates", as the authors do, lets protected
//   tokens use up segment quotas, and a global top-k over the surplus candidates can again empty
//   a region: the guarantee AMS exists for would be lost.) Every segment therefore keeps its
//   quota, at least min(len, min_keep) whenever the budget covers the minimums.
// - The selection itself stays the library's per-row top-k: the allocator lowers every
//   unprotected non-candidate score to -inf (candidates at -inf are raised to the lowest finite
//   float), so the top-k takes exactly the candidates. `scores` handed back show the mask. The
//   authors' global top-k fallback can never be needed and is not implemented.
// - Defaults follow algorithms.md (window 32, kernel 5, segment_mass 0.02, min_seg_len 32,
//   max_seg_len 1024, min_keep 8, sinks 4, keep_last 32, lambda 0.8, beta 0.7); the authors'
//   code defaults differ in places (segments 64..2048, no sinks or last tokens).
// - Per KV head throughout (mass, segments, quotas, candidates); the authors' window maximum is
//   taken over the whole tensor, here over the row. The window is w = min(window, queries
//   given); with no token before the window the mass is uniform.
// - A budget below the protected tokens cuts them (the newest first, then the sinks) with a
//   warning, the library's convention (pipeline.hpp); the authors clamp. The protected count
//   includes sinks + keep_last, so layer and head allocators earlier in the chain never go
//   below it.
// - If the minimums alone exceed the budget, they are lowered round-robin (segment 0 first) to
//   1, and with more segments than budget, to 0 (the authors' loop stops at 1 and then never
//   terminates).
// - Credit state: per token, [L][Hkv][stride] floats passed as EventInfo::alloc_state; the
//   allocator reads credit_prev and writes the updated credit of every token of the event (rows
//   with nothing to evict too). The owner zeroes new tokens and compacts the state with the
//   cache. Without state every credit_prev is 0 (a first event): m equals m_cur up to rounding.
// - Sums over a row's tokens (the three normalizations of steps 1-2) run in a fixed lane order
//   and the credit/mix products are fused multiply-adds (allocators/ams_rows.hpp), so that the
//   CUDA path (cuda/ams.hpp) computes the same mass bit for bit; the pooling sums each window
//   directly (row_math::pool_at).
// - Runs at prefill and at any later compression event alike; when it runs is the engine's
//   business (authors: every 512 decode steps).
#pragma once
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <span>
#include <vector>

#include "kvpolicy/concepts.hpp"
#include "kvpolicy/core/params.hpp"
#include "kvpolicy/core/topk_key.hpp"
#include "kvpolicy/allocators/ams_rows.hpp"
#include "kvpolicy/scorers/snapkv_row.hpp"

namespace kvpolicy {

namespace ams {

struct Segment {
  std::int64_t begin = 0, end = 0;
  std::int64_t size() const { return end - begin; }
  bool operator==(const Segment&) const = default;
};

namespace detail {
// The sum of x in ams_rows.hpp's lane order (the kernel's).
inline double lane_total(std::span<const double> x) {
  double lanes[rows::kMassLanes];
  for (int l = 0; l < rows::kMassLanes; ++l)
    lanes[l] = rows::lane_sum(x.data(), static_cast<std::int64_t>(x.size()), l);
  return rows::lanes_total(lanes);
}
}  // namespace detail

// relu, + eps, divided by the sum: a distribution (the authors' _to_mass).
inline void normalize(std::span<double> x) {
  double s = 0;
  for (double& v : x) {
    v = std::max(v, 0.0) + 1e-12;
    s += v;
  }
  for (double& v : x) v /= s;
}

// m_cur of one row from its window-attention column sums `attn` (w window queries): phases A-B
// of ams_rows.hpp, normalized.
inline std::vector<double> current_mass(std::span<const float> attn, std::int64_t w, int kernel) {
  const auto T = static_cast<std::int64_t>(attn.size());
  const std::int64_t pooled = T - std::min(w, T);
  float mx = -std::numeric_limits<float>::infinity();
  std::vector<double> m(static_cast<std::size_t>(T));
  for (std::int64_t j = 0; j < pooled; ++j) {
    const float p = rows::mass_pooled(attn.data(), pooled, j, kernel);
    m[static_cast<std::size_t>(j)] = p;
    mx = std::max(mx, p);
  }
  for (std::int64_t j = 0; j < T; ++j) {
    double& x = m[static_cast<std::size_t>(j)];
    x = rows::mass_current(static_cast<float>(x), pooled, j, mx);  // (a float kept as a double)
  }
  const double s = detail::lane_total(m);
  for (double& v : m) v /= s;
  return m;
}

// credit <- lambda credit + (1 - lambda) m_cur, in place; returns the mixed mass
// normalize(beta m_cur + (1 - beta) normalize(credit)): phases C-E of ams_rows.hpp.
inline std::vector<double> update_credit(std::span<float> credit, std::span<const double> m_cur,
                                         double lambda, double beta) {
  const std::size_t T = m_cur.size();
  std::vector<double> m(T);
  for (std::size_t j = 0; j < T; ++j) {
    credit[j] = rows::credit_next(credit[j], m_cur[j], lambda);
    m[j] = rows::relu_eps(credit[j]);
  }
  const double s2 = detail::lane_total(m);
  for (std::size_t j = 0; j < T; ++j) m[j] = rows::mass_mix(m_cur[j], m[j], s2, beta);
  const double s3 = detail::lane_total(m);
  for (double& v : m) v /= s3;
  return m;
}

// Step 3: segments covering [0, T) from the row's mass.
inline std::vector<Segment> segments(std::span<const double> mass, double segment_mass,
                                     std::int64_t min_len, std::int64_t max_len) {
  const auto T = static_cast<std::int64_t>(mass.size());
  std::vector<Segment> out;
  if (T == 0) return out;
  std::vector<double> cum(mass.size());
  std::partial_sum(mass.begin(), mass.end(), cum.begin());
  std::vector<std::int64_t> cuts{0};
  for (double k = 1;;) {
    const double target = k * segment_mass;
    if (target >= 1.0 - 1e-12) break;
    const std::int64_t idx = std::lower_bound(cum.begin(), cum.end(), target) - cum.begin();
    const std::int64_t c = std::clamp<std::int64_t>(idx, 1, std::max<std::int64_t>(1, T - 1));
    if (c > cuts.back() && c < T) cuts.push_back(c);
    if (idx >= T) break;  // no token reaches this target, nor any higher one
    // Targets below cum[idx] land on the same token: skip them (O(T) iterations; the last one
    // below is tried again in case k * segment_mass rounds above cum[idx]).
    k = std::max(k + 1, std::floor(cum[static_cast<std::size_t>(idx)] / segment_mass));
  }
  cuts.push_back(T);
  std::vector<Segment> split;
  for (std::size_t i = 0; i + 1 < cuts.size(); ++i) {
    std::int64_t s = cuts[i];
    const std::int64_t e = cuts[i + 1];
    for (; e - s > max_len; s += max_len) split.push_back({s, s + max_len});
    if (e > s) split.push_back({s, e});
  }
  for (std::size_t i = 0; i < split.size(); ++i) {
    Segment seg = split[i];
    while (seg.size() < min_len && i + 1 < split.size()) seg.end = split[++i].end;
    out.push_back(seg);
  }
  return out;
}

namespace detail {
// Round-robin passes over the entries (index order), moving each eligible one by `dir` until
// the sum reaches `target`. `eligible(i)` must stay false once it turns false.
template <class Eligible>
void round_robin(std::vector<std::int64_t>& q, std::int64_t& sum, std::int64_t target, int dir,
                 Eligible&& eligible) {
  std::vector<std::size_t> live;
  for (std::size_t i = 0; i < q.size(); ++i)
    if (eligible(i)) live.push_back(i);
  while (sum != target && !live.empty()) {
    std::size_t keep = 0;
    for (std::size_t k = 0; k < live.size(); ++k) {
      const std::size_t i = live[k];
      if (sum != target && eligible(i)) {
        q[i] += dir;
        sum += dir;
      }
      if (eligible(i)) live[keep++] = i;
    }
    live.resize(keep);
  }
}
}  // namespace detail

// Step 4: per-segment quotas summing to exactly `budget` (0 <= budget <= total length).
inline std::vector<std::int64_t> quotas(std::span<const Segment> segs,
                                        std::span<const double> seg_mass, std::int64_t budget,
                                        std::int64_t min_keep) {
  const std::size_t n = segs.size();
  std::vector<std::int64_t> q(n), base(n);
  std::int64_t sum = 0, total_len = 0;
  for (std::size_t i = 0; i < n; ++i) {
    base[i] = q[i] = std::min(segs[i].size(), min_keep);
    sum += q[i];
    total_len += segs[i].size();
  }
  KVP_REQUIRE(budget >= 0 && budget <= total_len, "ams: budget ", budget,
              " is outside [0, ", total_len, "]");
  if (sum >= budget) {
    for (std::int64_t floor : {std::int64_t{1}, std::int64_t{0}})
      detail::round_robin(q, sum, budget, -1, [&](std::size_t i) { return q[i] > floor; });
    return q;
  }
  const std::int64_t remain = budget - sum;
  const double total_mass = std::accumulate(seg_mass.begin(), seg_mass.end(), 0.0) + 1e-12;
  sum = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const auto add = static_cast<std::int64_t>(
        std::nearbyint(static_cast<double>(remain) * (seg_mass[i] / total_mass)));
    q[i] = std::min(segs[i].size(), base[i] + add);
    sum += q[i];
  }
  detail::round_robin(q, sum, budget, -1, [&](std::size_t i) { return q[i] > base[i]; });
  detail::round_robin(q, sum, budget, +1, [&](std::size_t i) { return q[i] < segs[i].size(); });
  return q;
}

// Step 5: marks the top quota_i tokens of each segment by `scores` (library order: higher
// score, then more recent).
inline void mark_candidates(std::span<const float> scores, std::span<const Segment> segs,
                            std::span<const std::int64_t> quota, std::vector<char>& cand) {
  cand.assign(scores.size(), 0);
  std::vector<std::uint64_t> keys;
  for (std::size_t i = 0; i < segs.size(); ++i) {
    keys.clear();
    for (std::int64_t j = segs[i].begin; j < segs[i].end; ++j)
      keys.push_back(topk_key(scores[static_cast<std::size_t>(j)], static_cast<std::int32_t>(j)));
    const auto k = static_cast<std::size_t>(quota[i]);
    if (k < keys.size())
      std::nth_element(keys.begin(), keys.begin() + static_cast<std::ptrdiff_t>(k), keys.end(),
                       std::greater<>());
    for (std::size_t t = 0; t < std::min(k, keys.size()); ++t)
      cand[static_cast<std::size_t>(topk_key_index(keys[t]))] = 1;
  }
}

}  // namespace ams

struct AMS {
  static constexpr std::string_view name = "ams";
  static constexpr AllocLevel level = AllocLevel::segments;
  static constexpr bool stateful = true;  // credit, per token (EventInfo::alloc_state)
  std::int64_t window = 32;
  int kernel = 5;
  double segment_mass = 0.02;
  std::int64_t min_seg_len = 32, max_seg_len = 1024, min_keep = 8;
  std::int64_t sinks = 4, keep_last = 32;
  double lambda = 0.8, beta = 0.7;

  void validate() const {
    KVP_REQUIRE(window >= 1, "ams: window must be >= 1, got ", window);
    KVP_REQUIRE(kernel >= 1 && kernel % 2 == 1, "ams: kernel must be odd and >= 1, got ", kernel);
    KVP_REQUIRE(std::isfinite(segment_mass) && segment_mass > 0 && segment_mass <= 1,
                "ams: segment_mass must be in (0, 1], got ", segment_mass);
    KVP_REQUIRE(min_seg_len >= 1, "ams: min_seg_len must be >= 1, got ", min_seg_len);
    KVP_REQUIRE(max_seg_len >= min_seg_len, "ams: max_seg_len (", max_seg_len,
                ") must be >= min_seg_len (", min_seg_len, ")");
    KVP_REQUIRE(min_keep >= 0, "ams: min_keep must be >= 0, got ", min_keep);
    KVP_REQUIRE(sinks >= 0, "ams: sinks must be >= 0, got ", sinks);
    KVP_REQUIRE(keep_last >= 0, "ams: keep_last must be >= 0, got ", keep_last);
    KVP_REQUIRE(std::isfinite(lambda) && lambda >= 0 && lambda < 1,
                "ams: lambda must be in [0, 1), got ", lambda);
    KVP_REQUIRE(std::isfinite(beta) && beta >= 0 && beta <= 1, "ams: beta must be in [0, 1], got ",
                beta);
  }
  static AMS from_params(Params& p) {
    AMS a;
    a.window = p.get_int("window", a.window);
    const std::int64_t k = p.get_int("kernel", a.kernel);
    KVP_REQUIRE(k >= 1 && k % 2 == 1 && k <= (1 << 20), "ams: kernel must be odd and >= 1, got ",
                k);
    a.kernel = static_cast<int>(k);
    a.segment_mass = p.get_double("segment_mass", a.segment_mass);
    a.min_seg_len = p.get_int("min_seg_len", a.min_seg_len);
    a.max_seg_len = p.get_int("max_seg_len", a.max_seg_len);
    a.min_keep = p.get_int("min_keep", a.min_keep);
    a.sinks = p.get_int("sinks", a.sinks);
    a.keep_last = p.get_int("keep_last", a.keep_last);
    a.lambda = p.get_double("lambda", a.lambda);
    a.beta = p.get_double("beta", a.beta);
    a.validate();
    return a;
  }

  Needs needs() const { return Needs::keys | Needs::queries; }
  std::int64_t query_window() const { return window; }
  Protect protects() const { return {sinks, keep_last}; }

  // Steps 1-2 for one row: the mass m; `credit` (T floats) is read and updated.
  std::vector<double> mass(std::span<const float> attn, std::int64_t w,
                           std::span<float> credit) const {
    return ams::update_credit(credit, ams::current_mass(attn, w, kernel), lambda, beta);
  }
  // Steps 3-5 for one row: marks (cand[j] = 1) the `budget` tokens kept among the unprotected
  // tokens [begin, end), from the row's mass m and scores.
  void candidates(std::span<const double> m, std::span<const float> scores, std::int64_t begin,
                  std::int64_t end, std::int64_t budget, std::vector<char>& cand) const {
    std::vector<double> mid(m.begin() + begin, m.begin() + end);
    ams::normalize(mid);
    auto segs = ams::segments(mid, segment_mass, min_seg_len, max_seg_len);
    std::vector<double> seg_mass(segs.size());
    for (std::size_t i = 0; i < segs.size(); ++i) {
      seg_mass[i] = std::accumulate(mid.begin() + segs[i].begin, mid.begin() + segs[i].end, 0.0);
      segs[i].begin += begin;
      segs[i].end += begin;
    }
    const auto q = ams::quotas(segs, seg_mass, budget, min_keep);
    ams::mark_candidates(scores, segs, q, cand);
  }

  void allocate(const AllocContext& ctx, std::span<std::int64_t> budgets) const {
    validate();
    const std::int64_t L = ctx.layers(), H = ctx.heads(), T = ctx.tokens;
    KVP_REQUIRE(static_cast<std::int64_t>(budgets.size()) == L * H, "ams: ", budgets.size(),
                " budgets for ", L * H, " (layer, head) rows");
    KVP_REQUIRE(ctx.queries > 0 && ctx.stats, "ams: needs the last ", window,
                " queries (window attention) but none were given");
    const std::int64_t w = std::min(window, ctx.queries);
    const ScoreMap* attn = ctx.stats->find(w, GqaReduce::mean);
    KVP_REQUIRE(attn && attn->layers() == L && attn->heads() == H && attn->tokens() == T,
                "ams: the window attention of the last ", w, " queries was not computed");
    const std::int64_t sinks_end = std::min(ctx.protect.sinks, T);
    const std::int64_t recent_begin = std::max(sinks_end, T - ctx.protect.recent);
    const std::int64_t n_protected = sinks_end + (T - recent_begin);
    if (ctx.state)  // checked before any is updated
      for (std::int64_t r = 0; r < L * H; ++r)
        for (std::int64_t j = 0; j < T; ++j) {
          const float c = ctx.state[r * ctx.state_stride + j];
          KVP_REQUIRE(std::isfinite(c) && c >= 0, "ams: credit state (EventInfo::alloc_state) of "
                      "layer ", r / H, ", head ", r % H, ", token ", j, " is ", c,
                      " (credits are finite and >= 0: zero a new sequence's)");
        }
    std::vector<float> zero;
    std::vector<char> cand;
    for (std::int64_t r = 0; r < L * H; ++r) {
      const std::int64_t B = budgets[static_cast<std::size_t>(r)];
      std::span<float> credit;
      if (ctx.state) {
        credit = {ctx.state + r * ctx.state_stride, static_cast<std::size_t>(T)};
      } else {
        zero.assign(static_cast<std::size_t>(T), 0.f);
        credit = zero;
      }
      const std::vector<double> m = mass(attn->row(r / H, r % H), w, credit);
      if (B >= T) continue;  // nothing to evict in this row; its credit still moves on
      KVP_REQUIRE(B >= n_protected, "ams: budget ", B, " of layer ", r / H, ", head ", r % H,
                  " is below the ", n_protected, " protected tokens");
      auto s = ctx.scores->row(r / H, r % H);
      candidates(m, s, sinks_end, recent_begin, B - n_protected, cand);
      for (std::int64_t j = sinks_end; j < recent_begin; ++j)
        s[static_cast<std::size_t>(j)] =
            ams::rows::mask_score(s[static_cast<std::size_t>(j)], cand[static_cast<std::size_t>(j)]);
    }
  }
};

}  // namespace kvpolicy

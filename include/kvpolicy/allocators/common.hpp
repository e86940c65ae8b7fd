// Integer apportionment shared by the allocators: real-valued targets become integer budgets
// that sum to an exact total and stay inside per-entry bounds, and the across-layers split that
// pyramid and depthkv share (one KV head's budget spread over the model's layers).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <queue>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "kvpolicy/concepts.hpp"
#include "kvpolicy/core/error.hpp"

namespace kvpolicy::alloc {

// Integers x[i] in [lo, hi[i]] summing exactly to `total`. Each starts as its target rounded half
// to even (Python's round(), which kvpress uses), clamped; then units are added to the entries
// whose targets exceed their values the most (removed from those that exceed their targets the
// most), lower index first on ties, until the sum is right. Exact targets that already sum to
// `total` come back unchanged.
inline std::vector<std::int64_t> round_to_total(std::span<const double> target, std::int64_t total,
                                                std::span<const std::int64_t> lo,
                                                std::span<const std::int64_t> hi,
                                                std::string_view who) {
  const std::size_t n = target.size();
  KVP_REQUIRE(lo.size() == n && hi.size() == n, who, ": bounds do not match the targets");
  std::int64_t lo_sum = 0, hi_sum = 0, sum = 0;
  std::vector<std::int64_t> x(n);
  for (std::size_t i = 0; i < n; ++i) {
    KVP_REQUIRE(lo[i] <= hi[i], who, ": entry ", i, " has bounds [", lo[i], ", ", hi[i], "]");
    KVP_REQUIRE(std::isfinite(target[i]), who, ": target ", i, " is not finite");
    lo_sum += lo[i];
    hi_sum += hi[i];
    const double r = std::nearbyint(std::clamp(target[i], static_cast<double>(lo[i]),
                                               static_cast<double>(hi[i])));
    x[i] = static_cast<std::int64_t>(r);
    sum += x[i];
  }
  KVP_REQUIRE(total >= lo_sum && total <= hi_sum, who, ": cannot split ", total,
              " tokens into entries bounded by [", lo_sum, ", ", hi_sum, "] in total");
  // Largest gap first; on equal gaps the lower index (priority_queue pops the largest pair).
  using Item = std::pair<double, std::int64_t>;  // (gap, -index)
  std::priority_queue<Item> pq;
  const int dir = sum < total ? 1 : -1;
  for (std::size_t i = 0; i < n && sum != total; ++i)
    if (dir > 0 ? x[i] < hi[i] : x[i] > lo[i])
      pq.emplace(dir * (target[i] - static_cast<double>(x[i])), -static_cast<std::int64_t>(i));
  while (sum != total) {
    const auto [gap, neg] = pq.top();
    pq.pop();
    const auto i = static_cast<std::size_t>(-neg);
    x[i] += dir;
    sum += dir;
    if (dir > 0 ? x[i] < hi[i] : x[i] > lo[i]) pq.emplace(gap - 1.0, neg);
  }
  return x;
}

// Real y[i] = clamp(c * w[i], lo[i], hi[i]) with the scale c chosen so that sum y = total, i.e.
// proportional shares whose clipped excess is redistributed over the unclipped entries in
// proportion to their weights (water-filling). All-zero weights count as equal weights. When even
// every positive-weight entry at its upper bound cannot reach `total`, they all sit there and the
// rest is left to round_to_total.
inline std::vector<double> water_fill(std::span<const double> w, double total,
                                      std::span<const double> lo, std::span<const double> hi) {
  const std::size_t n = w.size();
  bool any = false;
  for (double v : w) any = any || v > 0;
  std::vector<double> ww(w.begin(), w.end());
  if (!any) std::fill(ww.begin(), ww.end(), 1.0);
  auto fill = [&](double c) {
    double s = 0;
    for (std::size_t i = 0; i < n; ++i) s += std::clamp(c * ww[i], lo[i], hi[i]);
    return s;
  };
  double c_hi = 0;
  for (std::size_t i = 0; i < n; ++i)
    if (ww[i] > 0) c_hi = std::max(c_hi, hi[i] / ww[i]);
  double a = 0, b = c_hi;
  if (fill(b) > total)
    for (int it = 0; it < 200 && a < b; ++it) {  // f is continuous and nondecreasing in c
      const double mid = 0.5 * (a + b);
      (fill(mid) < total ? a : b) = mid;
    }
  std::vector<double> y(n);
  for (std::size_t i = 0; i < n; ++i) y[i] = std::clamp(b * ww[i], lo[i], hi[i]);
  return y;
}

// Splits the budget of every KV head across the model's layers. For head h the event's rows
// (l, h) have mean m_h; targets(m_h) gives real budgets for all ctx.model_layers layers, which are
// rounded into [lo, T] (lo at least ctx.min_keep()) with round_to_total so that they sum to the column's sum when
// the event holds every layer (exact conservation), and to llround(model_layers * m_h) when it
// holds only some (each event then conserves the model's budget, not its own: a Session that
// compresses layer by layer gives every layer the same m_h, and the layers' budgets sum to
// model_layers * m_h exactly). Each event layer then takes its own entry.
template <class Targets>
void split_across_layers(const AllocContext& ctx, std::span<std::int64_t> budgets,
                         std::string_view who, std::int64_t lo, Targets&& targets) {
  const std::int64_t L = ctx.layers(), H = ctx.heads(), T = ctx.tokens, Lm = ctx.model_layers;
  KVP_REQUIRE(static_cast<std::int64_t>(budgets.size()) == L * H, who, ": ", budgets.size(),
              " budgets for ", L * H, " (layer, head) rows");
  KVP_REQUIRE(Lm >= L && ctx.first_layer >= 0 && ctx.first_layer + L <= Lm, who, ": event layers [",
              ctx.first_layer, ", ", ctx.first_layer + L, ") do not fit a model of ", Lm, " layers");
  lo = std::min(std::max(lo, ctx.min_keep()), T);
  const std::vector<std::int64_t> lo_v(static_cast<std::size_t>(Lm), lo),
      hi_v(static_cast<std::size_t>(Lm), T);
  for (std::int64_t h = 0; h < H; ++h) {
    std::int64_t col = 0;
    for (std::int64_t l = 0; l < L; ++l) col += budgets[static_cast<std::size_t>(l * H + h)];
    const double m = static_cast<double>(col) / static_cast<double>(L);
    const std::int64_t total = L == Lm ? col : std::llround(m * static_cast<double>(Lm));
    const std::vector<double> y = targets(m);
    KVP_REQUIRE(static_cast<std::int64_t>(y.size()) == Lm, who, ": ", y.size(),
                " layer targets for ", Lm, " layers");
    const auto x = round_to_total(y, total, lo_v, hi_v, who);
    for (std::int64_t l = 0; l < L; ++l)
      budgets[static_cast<std::size_t>(l * H + h)] = x[static_cast<std::size_t>(ctx.first_layer + l)];
  }
}

}  // namespace kvpolicy::alloc

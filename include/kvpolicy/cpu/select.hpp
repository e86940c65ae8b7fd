// CPU reference selection: per (layer, head), keep the protected tokens (first `sinks`, last
// `recent`) and fill the rest of the row's budget with the best other tokens under the library's
// total order (topk_key: higher score, then more recent). Output ascending.
// A kept set is therefore an exact function of the scores' bits. The scores themselves are the
// same for any thread count, but not between builds of different SIMD width: the Eigen kernels
// of window_attention.hpp and attention.hpp (GEMM, exp) round differently with AVX-512 and FMA
// (-march=native) than with SSE2, also with -ffp-contract=off (Eigen's FMAs are explicit). Kept
// sets then differ only where two scores are within rounding of each other at the cut (README,
// "Determinism", measures it on the accuracy benchmark's prompts).
#pragma once
#include <algorithm>
#include <cmath>
#include <span>
#include <vector>

#include "kvpolicy/core/inputs.hpp"
#include "kvpolicy/core/selection.hpp"
#include "kvpolicy/core/topk_key.hpp"
#include "kvpolicy/core/parallel.hpp"

namespace kvpolicy::cpu {

inline void select_row(std::span<const float> scores, std::int64_t budget, Protect p,
                       std::vector<std::int32_t>& kept, std::vector<std::uint64_t>& scratch) {
  const std::int64_t T = static_cast<std::int64_t>(scores.size());
  kept.clear();
  if (budget >= T) {
    kept.resize(static_cast<std::size_t>(T));
    for (std::int64_t j = 0; j < T; ++j) kept[static_cast<std::size_t>(j)] = static_cast<std::int32_t>(j);
    return;
  }
  const std::int64_t sinks = std::min(p.sinks, T);
  const std::int64_t recent_begin = std::max(sinks, T - p.recent);
  const std::int64_t n_protected = sinks + (T - recent_begin);
  KVP_REQUIRE(budget >= n_protected, "budget of ", budget, " tokens is below the ",
              n_protected, " protected tokens (", p.sinks, " sinks + ", p.recent, " recent)");
  scratch.clear();
  for (std::int64_t j = sinks; j < recent_begin; ++j) {
    KVP_REQUIRE(!std::isnan(scores[static_cast<std::size_t>(j)]), "score of token ", j,
                " is NaN");
    scratch.push_back(topk_key(scores[static_cast<std::size_t>(j)], static_cast<std::int32_t>(j)));
  }
  const auto m = static_cast<std::size_t>(budget - n_protected);
  if (m < scratch.size())
    std::nth_element(scratch.begin(), scratch.begin() + static_cast<std::ptrdiff_t>(m),
                     scratch.end(), std::greater<>());
  kept.reserve(static_cast<std::size_t>(budget));
  for (std::int64_t j = 0; j < sinks; ++j) kept.push_back(static_cast<std::int32_t>(j));
  for (std::size_t i = 0; i < std::min(m, scratch.size()); ++i)
    kept.push_back(topk_key_index(scratch[i]));
  std::sort(kept.begin() + sinks, kept.end());
  for (std::int64_t j = recent_begin; j < T; ++j) kept.push_back(static_cast<std::int32_t>(j));
}

// budgets: one entry per (layer, head), row-major.
inline void select(const cpu_backend& be, const ScoreMap& scores,
                   std::span<const std::int64_t> budgets, Protect p, Selection& out) {
  const std::int64_t L = scores.layers(), H = scores.heads();
  KVP_REQUIRE(static_cast<std::int64_t>(budgets.size()) == L * H, "select: ", budgets.size(),
              " budgets for ", L * H, " (layer, head) rows");
  for (std::int64_t b : budgets) KVP_REQUIRE(b >= 0, "select: negative budget ", b);
  out = Selection(L, H);
  parallel_for(be, L * H, [&](std::int64_t r) {
    std::vector<std::uint64_t> scratch;
    select_row(scores.row(r / H, r % H), budgets[static_cast<std::size_t>(r)], p,
               out.kept(r / H, r % H), scratch);
  });
}

}  // namespace kvpolicy::cpu

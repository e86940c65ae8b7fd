// KeyDiff (as in kvpress): score = -cos(k_j, a) with anchor a = mean_i(k_i / ||k_i||) over the
// head's keys; keys pointing away from the average direction are kept. [ours] a zero key has
// cosine 0 (kvpress clamps norms with eps, which gives the same result).
#pragma once
#include <cmath>
#include <vector>

#include "kvpolicy/core/params.hpp"
#include "kvpolicy/scorers/common.hpp"
#include "kvpolicy/scorers/keydiff_row.hpp"

namespace kvpolicy {

struct KeyDiff {
  static constexpr std::string_view name = "keydiff";

  static KeyDiff from_params(Params&) { return {}; }
  Needs needs() const { return Needs::keys; }
  std::int64_t query_window() const { return 0; }
  Protect protect(std::int64_t, std::int64_t) const { return {0, 0}; }

  template <Element T>
  void score(const cpu_backend& be, const Inputs<T>& in, Stats&, ScoreMap& out) const {
    const auto& k = in.keys;
    out.resize(k.layers, k.heads, k.tokens);
    cpu::parallel_for(be, k.layers * k.heads, [&](std::int64_t r) {
      const std::int64_t l = r / k.heads, h = r % k.heads, d = k.dim;
      std::vector<float> row(static_cast<std::size_t>(d)), norms(static_cast<std::size_t>(k.tokens));
      std::vector<double> anchor(static_cast<std::size_t>(d), 0.0);
      for (std::int64_t j = 0; j < k.tokens; ++j) {
        double n2 = 0;
        for (std::int64_t i = 0; i < d; ++i) {
          const double x = to_float(k.at(l, h, j, i));
          n2 += x * x;
        }
        const double n = std::sqrt(n2);
        norms[static_cast<std::size_t>(j)] = static_cast<float>(n);
        if (n > 0)
          for (std::int64_t i = 0; i < d; ++i)
            anchor[static_cast<std::size_t>(i)] += row_math::anchor_term(to_float(k.at(l, h, j, i)), n);
      }
      double an2 = 0;
      for (auto& a : anchor) {
        a /= static_cast<double>(k.tokens);
        an2 += a * a;
      }
      const double an = std::sqrt(an2);
      auto dst = out.row(l, h);
      for (std::int64_t j = 0; j < k.tokens; ++j) {
        double dot = 0;
        for (std::int64_t i = 0; i < d; ++i) dot += to_float(k.at(l, h, j, i)) * anchor[static_cast<std::size_t>(i)];
        dst[j] = row_math::keydiff_score(norms[static_cast<std::size_t>(j)], dot, an);
      }
    });
  }
};

}  // namespace kvpolicy

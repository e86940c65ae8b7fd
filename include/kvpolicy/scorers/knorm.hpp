// KNorm (as in kvpress): score = -||k_j||_2; keys with small norms tend to draw large attention.
#pragma once
#include <cmath>

#include "kvpolicy/core/params.hpp"
#include "kvpolicy/scorers/common.hpp"
#include "kvpolicy/scorers/knorm_row.hpp"

namespace kvpolicy {

struct KNorm {
  static constexpr std::string_view name = "knorm";

  static KNorm from_params(Params&) { return {}; }
  Needs needs() const { return Needs::keys; }
  std::int64_t query_window() const { return 0; }
  Protect protect(std::int64_t, std::int64_t) const { return {0, 0}; }

  template <Element T>
  void score(const cpu_backend& be, const Inputs<T>& in, Stats&, ScoreMap& out) const {
    const auto& k = in.keys;
    out.resize(k.layers, k.heads, k.tokens);
    cpu::parallel_for(be, k.layers * k.heads, [&](std::int64_t r) {
      const std::int64_t l = r / k.heads, h = r % k.heads;
      auto dst = out.row(l, h);
      for (std::int64_t j = 0; j < k.tokens; ++j) {
        float s = 0;
        for (std::int64_t i = 0; i < k.dim; ++i) {
          const float x = to_float(k.at(l, h, j, i));
          s += x * x;
        }
        dst[j] = row_math::knorm_finish(s);
      }
    });
  }
};

}  // namespace kvpolicy

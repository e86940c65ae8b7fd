// TOVA (Oren et al. 2024, as in kvpress): score = attention of the last query, averaged over all
// query heads, so every KV head of a layer shares one choice; the newest token is pinned.
#pragma once
#include "kvpolicy/core/params.hpp"
#include "kvpolicy/scorers/common.hpp"

namespace kvpolicy {

struct TOVA {
  static constexpr std::string_view name = "tova";

  static TOVA from_params(Params&) { return {}; }
  Needs needs() const { return Needs::keys | Needs::queries; }
  std::int64_t query_window() const { return 1; }
  Protect protect(std::int64_t, std::int64_t) const { return {0, 1}; }

  template <Element T>
  void score(const cpu_backend& be, const Inputs<T>& in, Stats& stats, ScoreMap& out) const {
    // Mean over the KV heads of group means == mean over all query heads (equal group sizes).
    const ScoreMap& a = window_attention_stat(be, in, stats, 1, GqaReduce::mean);
    const std::int64_t H = in.kv_heads(), Tk = in.tokens();
    out.resize(in.layers(), H, Tk);
    for (std::int64_t l = 0; l < in.layers(); ++l) {
      auto first = out.row(l, 0);
      for (std::int64_t j = 0; j < Tk; ++j) {
        float s = 0;
        for (std::int64_t h = 0; h < H; ++h) s += a.row(l, h)[j];
        first[j] = s / static_cast<float>(H);
      }
      for (std::int64_t h = 1; h < H; ++h) std::copy(first.begin(), first.end(), out.row(l, h).begin());
    }
  }
};

}  // namespace kvpolicy

// TOVA (Oren et al. 2024, as in kvpress): score = attention of the last query, averaged over all
// query heads, so every KV head of a layer shares one choice; the newest token is pinned.
// Under tensor parallelism over KV heads (EventInfo::shard) the mean takes every rank's heads:
// the ranks exchange their window attention (4 T bytes per head and layer).
#pragma once
#include "kvpolicy/core/params.hpp"
#include "kvpolicy/scorers/common.hpp"

namespace kvpolicy {

struct TOVA {
  static constexpr std::string_view name = "tova";
  static constexpr bool spans_heads = true;  // one mean over the layer's KV heads

  static TOVA from_params(Params&) { return {}; }
  Needs needs() const { return Needs::keys | Needs::queries; }
  std::int64_t query_window() const { return 1; }
  Protect protect(std::int64_t, std::int64_t) const { return {0, 1}; }

  template <Element T>
  void score(const cpu_backend& be, const Inputs<T>& in, Stats& stats, ScoreMap& out) const {
    // Mean over the KV heads of group means == mean over all query heads (equal group sizes).
    const ScoreMap& a = window_attention_stat(be, in, stats, 1, GqaReduce::mean);
    const std::int64_t L = in.layers(), H = in.kv_heads(), Tk = in.tokens();
    out.resize(L, H, Tk);
    // Every KV head's row in model order: this event's own, or every rank's.
    std::vector<const float*> rows(static_cast<std::size_t>(L * H));
    std::int64_t Hm = H;
    std::vector<float> gathered;
    if (detail::sharded(in.shard)) {
      std::vector<std::int64_t> counts;
      gathered = detail::all_gather_v(*in.shard, std::span<const float>(a.data(), static_cast<std::size_t>(L * H * Tk)), &counts);
      Hm = 0;
      for (std::int64_t c : counts) Hm += L * Tk > 0 ? c / (L * Tk) : 0;
      rows.assign(static_cast<std::size_t>(L * Hm), nullptr);
      std::int64_t base = 0, h0 = 0;
      for (std::int64_t c : counts) {
        const std::int64_t hr = L * Tk > 0 ? c / (L * Tk) : 0;
        for (std::int64_t l = 0; l < L; ++l)
          for (std::int64_t h = 0; h < hr; ++h)
            rows[static_cast<std::size_t>(l * Hm + h0 + h)] = gathered.data() + base + (l * hr + h) * Tk;
        base += c;
        h0 += hr;
      }
    } else {
      for (std::int64_t l = 0; l < L; ++l)
        for (std::int64_t h = 0; h < H; ++h) rows[static_cast<std::size_t>(l * H + h)] = a.row(l, h).data();
    }
    for (std::int64_t l = 0; l < L; ++l) {
      auto first = out.row(l, 0);
      for (std::int64_t j = 0; j < Tk; ++j) {
        float s = 0;
        for (std::int64_t h = 0; h < Hm; ++h) s += rows[static_cast<std::size_t>(l * Hm + h)][j];
        first[j] = s / static_cast<float>(Hm);
      }
      for (std::int64_t h = 1; h < H; ++h) std::copy(first.begin(), first.end(), out.row(l, h).begin());
    }
  }
};

}  // namespace kvpolicy

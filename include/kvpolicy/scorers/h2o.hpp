// H2O (Zhang et al. 2023): heavy hitters + recent window. A key's score is the attention it has
// accumulated from every query so far: acc[h, j] = sum_i A[h, i, j] (GQA-reduced). The `recent`
// fraction of the budget goes to the newest tokens, the rest to the highest accumulators.
// Authors' runs split a 20% cache as heavy 0.1 + recent 0.1, hence recent=0.5 by default.
// The accumulator is state: a Session keeps it per token, adds each decode query's attention row
// and compacts it with K/V (greedy one-token eviction at decode). Without given state the scorer
// computes column sums from the queries blockwise (never a T x T matrix).
// normalize=true divides by the number of queries that saw each key (kvpress's
// ObservedAttentionPress); with queries only, that count is T - max(j, T - n_q).
// [ours] recent is a fraction of the budget (0..1) or, with recent_tokens=N, a token count.
// preset=observed is kvpress's ObservedAttentionPress: recent_tokens=0, normalize=true (the
// question-agnostic fidelity leader of the evaluation); explicit parameters override it.
#pragma once
#include <cmath>

#include "kvpolicy/core/params.hpp"
#include "kvpolicy/scorers/common.hpp"
#include "kvpolicy/scorers/h2o_row.hpp"

namespace kvpolicy {

struct H2O {
  static constexpr std::string_view name = "h2o";
  double recent = 0.5;              // fraction of the budget kept as the newest tokens
  std::int64_t recent_tokens = -1;  // overrides `recent` when >= 0
  std::int64_t sinks = 0;
  bool normalize = false;
  GqaReduce reduce = GqaReduce::mean;

  void validate() const {
    KVP_REQUIRE(std::isfinite(recent) && recent >= 0 && recent <= 1,
                "h2o: recent must be a fraction in [0, 1], got ", recent);
    KVP_REQUIRE(sinks >= 0, "h2o: sinks must be >= 0, got ", sinks);
    KVP_REQUIRE(recent_tokens >= -1, "h2o: recent_tokens must be >= 0, got ", recent_tokens);
  }
  static H2O from_params(Params& p) {
    H2O s;
    if (p.get_choice("preset", "authors", {"authors", "observed"}) == "observed") {
      s.recent_tokens = 0;
      s.normalize = true;
    }
    s.recent = p.get_double("recent", s.recent);
    s.recent_tokens = p.get_int("recent_tokens", s.recent_tokens);
    s.sinks = p.get_int("sinks", 0);
    s.normalize = p.get_bool("normalize", s.normalize);
    s.reduce = parse_reduce(p.get_choice("reduce", "mean", {"mean", "max", "sum"}));
    s.validate();
    return s;
  }

  Needs needs() const { return Needs::keys | Needs::accumulated; }
  std::int64_t query_window() const { return -1; }
  // Decode-time: the sums grow at every step (detail::accumulates, Policy::accumulation()).
  GqaReduce accumulation() const { return reduce; }
  Protect protect(std::int64_t, std::int64_t budget) const {
    const std::int64_t r = recent_tokens >= 0
                               ? recent_tokens
                               : static_cast<std::int64_t>(std::floor(recent * budget));
    return {sinks, std::max<std::int64_t>(0, std::min(r, budget - sinks))};
  }

  template <Element T>
  void score(const cpu_backend& be, const Inputs<T>& in, Stats& stats, ScoreMap& out) const {
    validate();
    const std::int64_t L = in.layers(), H = in.kv_heads(), Tk = in.tokens();
    KVP_REQUIRE(in.accumulated || (in.queries.data && in.queries.tokens > 0),
                "h2o: needs accumulated attention or the queries to compute it");
    out.resize(L, H, Tk);
    if (in.accumulated) {
      KVP_REQUIRE(!normalize || in.observed, "h2o: normalize=true with given accumulators "
                                             "also needs the observed-query counts");
      const std::int64_t st = in.state_row_stride();
      cpu::parallel_for(be, L * H, [&](std::int64_t r) {
        auto dst = out.row(r / H, r % H);
        const float* acc = in.accumulated + r * st;
        const float* obs = in.observed ? in.observed + r * st : nullptr;
        for (std::int64_t j = 0; j < Tk; ++j)
          dst[j] = row_math::h2o_from_state(acc[j], obs ? obs + j : nullptr, normalize);
      });
      return;
    }
    const ScoreMap& colsum = window_attention_stat(be, in, stats, -1, reduce);
    const std::int64_t nq = in.queries.tokens;
    cpu::parallel_for(be, L * H, [&](std::int64_t r) {
      auto dst = out.row(r / H, r % H);
      auto src = colsum.row(r / H, r % H);
      for (std::int64_t j = 0; j < Tk; ++j)
        dst[j] = normalize ? src[j] / row_math::h2o_seen(j, nq, Tk) : src[j];
    });
  }
};

}  // namespace kvpolicy

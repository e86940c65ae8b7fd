// StreamingLLM (Xiao et al. 2023): keep `sinks` attention-sink tokens (default 4, the authors'
// start size) and the newest tokens. Score = position, so the top-k fills with the newest.
#pragma once
#include "kvpolicy/core/params.hpp"
#include "kvpolicy/scorers/common.hpp"
#include "kvpolicy/scorers/streaming_row.hpp"

namespace kvpolicy {

struct Streaming {
  static constexpr std::string_view name = "streaming";
  std::int64_t sinks = 4;

  static Streaming from_params(Params& p) {
    Streaming s{p.get_int("sinks", 4)};
    KVP_REQUIRE(s.sinks >= 0, "streaming: sinks must be >= 0, got ", s.sinks);
    return s;
  }
  Needs needs() const { return Needs::keys; }
  std::int64_t query_window() const { return 0; }
  Protect protect(std::int64_t, std::int64_t) const { return {sinks, 0}; }

  template <Element T>
  void score(const cpu_backend&, const Inputs<T>& in, Stats&, ScoreMap& out) const {
    out.resize(in.layers(), in.kv_heads(), in.tokens());
    for (std::int64_t l = 0; l < in.layers(); ++l)
      for (std::int64_t h = 0; h < in.kv_heads(); ++h) {
        auto r = out.row(l, h);
        for (std::int64_t j = 0; j < in.tokens(); ++j) r[j] = row_math::streaming_at(j);
      }
  }
};

}  // namespace kvpolicy

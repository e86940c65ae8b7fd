// Statistics shared by several scorers, memoized per compression event in Stats. The CPU ops
// they run are declared in cpu/fwd.hpp (defined in cpu/, included by registry.hpp).
#pragma once
#include "kvpolicy/core/inputs.hpp"
#include "kvpolicy/cpu/fwd.hpp"

namespace kvpolicy {

// The last n of a view's tokens.
template <class T>
KVView<T> last_tokens(const KVView<T>& v, std::int64_t n) {
  KVView<T> out = v;
  out.data = v.tokens > n ? v.row(0, 0, v.tokens - n) : v.data;
  out.tokens = std::min(n, v.tokens);
  return out;
}

// Column sums of the attention of the last `window` queries (all given queries if window < 0),
// reduced over GQA groups: [L][Hkv][T]. Computed once per event and key.
template <Element T>
const ScoreMap& window_attention_stat(const cpu_backend& be, const Inputs<T>& in, Stats& stats,
                                      std::int64_t window, GqaReduce reduce) {
  const std::int64_t n = window < 0 ? in.queries.tokens : std::min(window, in.queries.tokens);
  if (const ScoreMap* hit = stats.find(n, reduce)) return *hit;
  ScoreMap& out = stats.slot(n, reduce);
  cpu::window_attention(be, in.keys, last_tokens(in.queries, n), reduce, out);
  return out;
}

inline GqaReduce parse_reduce(const std::string& s) {
  return s == "max" ? GqaReduce::max : s == "sum" ? GqaReduce::sum : GqaReduce::mean;
}

}  // namespace kvpolicy

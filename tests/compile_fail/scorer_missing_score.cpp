// A scorer without score(): Pipeline must reject it with its readable static_assert.
// expect-error: S must model kvpolicy::Scorer
// expect-error: s\.score\(be, in, st, out\)
#include <kvpolicy/kvpolicy.hpp>

struct NoScore {
  static constexpr std::string_view name = "no_score";
  kvpolicy::Needs needs() const { return kvpolicy::Needs::keys; }
  std::int64_t query_window() const { return 0; }
  kvpolicy::Protect protect(std::int64_t, std::int64_t) const { return {}; }
};

kvpolicy::Pipeline<NoScore> pipeline;

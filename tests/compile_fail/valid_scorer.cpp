// Control case: a user-defined scorer and allocator that model the concepts. It must compile, so
// that the other cases in this directory fail only because of the requirement they break.
#include <kvpolicy/kvpolicy.hpp>

struct ByPosition {
  static constexpr std::string_view name = "by_position";
  kvpolicy::Needs needs() const { return kvpolicy::Needs::keys; }
  std::int64_t query_window() const { return 0; }
  kvpolicy::Protect protect(std::int64_t, std::int64_t) const { return {1, 0}; }
  template <kvpolicy::Element T>
  void score(const kvpolicy::cpu_backend&, const kvpolicy::Inputs<T>& in, kvpolicy::Stats&,
             kvpolicy::ScoreMap& out) const {
    out.resize(in.layers(), in.kv_heads(), in.tokens());
  }
};

struct KeepAsIs {
  static constexpr std::string_view name = "keep_as_is";
  void allocate(const kvpolicy::AllocContext&, std::span<std::int64_t>) const {}
};

static_assert(kvpolicy::Scorer<ByPosition>);
static_assert(kvpolicy::Allocator<KeepAsIs>);

kvpolicy::Selection run(const kvpolicy::Inputs<kvpolicy::half>& in) {
  const kvpolicy::Pipeline<ByPosition, KeepAsIs, kvpolicy::Uniform> p;
  return p.select(kvpolicy::cpu_backend{}, in, kvpolicy::Budget::ratio(0.5));
}

// A scorer that owns heap memory is not trivially copyable, so it cannot be passed into a kernel.
// expect-error: S must model kvpolicy::Scorer
// expect-error: is_trivially_copyable_v<S>
#include <string>

#include <kvpolicy/kvpolicy.hpp>

struct OwnsAString {
  static constexpr std::string_view name = "owns_a_string";
  std::string label = "not trivially copyable";
  kvpolicy::Needs needs() const { return kvpolicy::Needs::keys; }
  std::int64_t query_window() const { return 0; }
  kvpolicy::Protect protect(std::int64_t, std::int64_t) const { return {}; }
  template <kvpolicy::Element T>
  void score(const kvpolicy::cpu_backend&, const kvpolicy::Inputs<T>&, kvpolicy::Stats&,
             kvpolicy::ScoreMap&) const {}
};

static_assert(!std::is_trivially_copyable_v<OwnsAString>);
kvpolicy::Pipeline<OwnsAString> pipeline;
